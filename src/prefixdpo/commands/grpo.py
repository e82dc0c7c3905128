"""`prefixdpo grpo [config.yaml] [--model M] [--dataset D] [--reward_funcs F ...] [--any-config-option V ...]`:
GRPO (TRL 1.16's `GRPOTrainer`) with each prompt computed once per log-prob pass, its completions as branches.

Options are TRL's `GRPOConfig` fields with TRL's names, defaults and meaning (a TRL GRPO YAML runs unchanged),
`transformers.TrainingArguments` (schedules, accumulation, bf16, checkpoints, DDP/FSDP/DeepSpeed), TRL's script
names for the data and rewards (`--dataset_name`, `--reward_funcs`, `--reward_model_name_or_path`), TRL's
`ModelConfig` and `ScriptArguments` as `trl grpo` parses them (`--model_revision`, `--dtype`,
`--attn_implementation`, LoRA exactly with `--use_peft` from the `--lora_*` options, QLoRA with `--load_in_4bit`,
`--dataset_test_split` read when `--eval_strategy` is not `no`), and the layout of the passes
(`--prefix_sharing`, `--packing`, `--pack_length`, `--attention`). Records need a `prompt` (text or messages);
their other fields reach the reward functions. Without `--model` and `--dataset`: the embedded default (a tiny
model, prompts sharing a long instruction, the reward `vowel_share`), which prints the reward rising and the tokens
prefix sharing saved (`make demo-grpo`). The YAML file's values are defaults that the command line overrides; every
boolean X also takes `--X true|false` and `--no_X`;
`--resume_from_checkpoint latest` resumes from the newest complete checkpoint of this run in output_dir. Runs
survive as `prefixdpo train` runs do: an output_dir of another run is refused (`--overwrite_output_dir true`
replaces it), SIGTERM/SIGUSR1 save a checkpoint after the current step and exit 75 (a first Ctrl-C: the same, exit
130; a second: at once), and a NaN/inf step is never applied (`--nonfinite stop|skip`), nor one whose rewards are all
None/NaN or hold an inf; a reward function that raises or returns anything but one number or None per completion
stops the run in one line (exit 2).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

# For the embedded default's random-init model; each applies only where neither the YAML file nor the command
# line sets it. Measured on 2 CPU cores: the reward (vowel share) goes from ~0.3 to ~0.9 in 40 steps of one
# prompt x 8 completions at a constant 3e-3 (1e-3 moved it to ~0.4 only). beta 0 (GRPO's default; RLOO's is
# 0.05): RLOO subtracts beta x a completion's KL to the reference from its reward, which on this model outweighs
# the reward differences (measured: 0.28 -> 0.31 in 40 steps with 0.05, 0.28 -> 0.85 with 0). TRL's gradient
# checkpointing and bf16 are off: the tiny model needs no memory saving, and fp32 keeps the numbers the same on
# every device.
DEMO_DEFAULTS: dict[str, str | list[str]] = {
    "beta": "0",
    "learning_rate": "3e-3",
    "lr_scheduler_type": "constant",
    "max_steps": "40",
    "per_device_train_batch_size": "8",
    "num_generations": "8",
    "max_completion_length": "16",
    "logging_steps": "5",
    "save_strategy": "no",
    "seed": "0",
    "gradient_checkpointing": "false",
    "bf16": "false",
    "reward_funcs": ["prefixdpo.demo_grpo:vowel_share"],
}


def _usage(command: str) -> str:
    return (f"prefixdpo {command} [config.yaml] [--model NAME_OR_PATH] [--dataset NAME_OR_PATH] "
            "[--reward_funcs NAME ...] [--output-dir DIR] [--OPTION VALUE ...]")


_RLOO_WORDS = (("prefixdpo grpo", "prefixdpo rloo"), ("GRPOConfig", "RLOOConfig"), ("TRL GRPO YAML", "TRL RLOO YAML"),
               ("GRPO (TRL 1.16's `GRPOTrainer`)", "RLOO (TRL 1.16's `RLOOTrainer`)"),
               ("make demo-grpo", "make demo-rloo"), ("trl grpo", "trl rloo"))


def _parser_kwargs(command: str) -> dict:
    from prefixdpo.commands.train import HelpFormatter

    description = __doc__
    if command == "rloo":  # the same command over TRL's other trainer
        for grpo, rloo in _RLOO_WORDS:
            description = description.replace(grpo, rloo)
    return {"prog": f"prefixdpo {command}", "usage": _usage(command), "description": description,
            "formatter_class": HelpFormatter}


def register(subparsers) -> None:
    # Every argument after the command is ours to parse (`pass_through`): TRL's config has ~200 options.
    p = subparsers.add_parser("grpo", add_help=False, usage=_usage("grpo"),
                              help="GRPO with prefix sharing (TRL's GRPOTrainer; no arguments: the embedded demo)")
    p.set_defaults(func=run, pass_through=True, group_method="grpo")


def _trainer_and_config(command: str):
    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer, PrefixRLOOConfig, PrefixRLOOTrainer

    return (PrefixGRPOTrainer, PrefixGRPOConfig) if command == "grpo" else (PrefixRLOOTrainer, PrefixRLOOConfig)


def _demo_defaults(command: str) -> dict[str, str | list[str]]:
    return {**DEMO_DEFAULTS, "output_dir": f"prefixdpo-output/demo-{command}"}


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _reward_callback():
    from transformers import TrainerCallback

    class RewardProgress(TrainerCallback):
        """One line per logged step: the mean reward of the steps since the last log and the tokens saved."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "reward" in logs:
                saved = logs.get("prefix_sharing/tokens_saved")
                print(f"step {state.global_step:>4}: reward {_fmt(logs['reward'])}  "
                      f"(tokens saved by prefix sharing: {'off' if saved is None else f'{saved:.1%}'})", flush=True)

    return RewardProgress()


@contextlib.contextmanager
def _without_trl_instance_warning(trainer_class):
    """TRL's trainers warn that `model_init_kwargs` are ignored when given a loaded model; here the model was loaded
    with them and TRL loads the reference and reward models with them, so that one line would be false."""
    import logging

    from trl import GRPOTrainer

    name = ("trl.trainer.grpo_trainer" if issubclass(trainer_class, GRPOTrainer) else "trl.trainer.rloo_trainer")
    drop = _DropMessage("but your model is already instantiated. The `model_init_kwargs` will be ignored")
    logger = logging.getLogger(name)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class _DropMessage:
    """A logging filter dropping the records whose message contains `text`."""

    def __init__(self, text: str):
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


def run(args) -> int:
    from prefixdpo.grpo.config import group_options, parse_group_args
    from prefixdpo.option_parser import OptionParser

    command = getattr(args, "group_method", "grpo")
    trainer_class, config_class = _trainer_and_config(command)
    argv = list(getattr(args, "extra_argv", []))
    if any(a in ("-h", "--help") for a in argv):
        OptionParser(group_options(config_class), **_parser_kwargs(command)).print_help()
        return 0
    config, model_args, script_args = parse_group_args(config_class, command, argv,
                                                       demo_defaults=_demo_defaults(command), **_parser_kwargs(command))
    from prefixdpo.training.options import eval_split, script_options_without_effect, state_options_without_effect

    state_options_without_effect(script_options_without_effect(config, script_args)
                                 + model_args.options_without_effect_in(config))
    # TRL's own PEFT and quantization configs, refused here (before any work) where they cannot be used
    peft_config = model_args.peft_config()
    load_kwargs = model_args.from_pretrained_kwargs(config.model_init_kwargs, config.trust_remote_code,
                                                    config.local_process_index)
    # as TRL's script: the reference (beta > 0, no LoRA) and reward models by name load with the model's arguments
    config.model_init_kwargs = model_args.script_model_init_kwargs(config.model_init_kwargs, config.trust_remote_code)

    from prefixdpo.grpo.data import load_prompts
    from prefixdpo.core.models import load_causal_lm, load_tokenizer
    from prefixdpo.grpo.rewards import resolve_rewards

    start = time.time()
    demo = None
    if model_args.model_name_or_path is None or script_args.dataset_name is None:
        from prefixdpo.demo_grpo import build_group_demo_for_run

        demo = build_group_demo_for_run(os.path.join(config.output_dir, "demo-base"), config)
        print(f"Embedded default built in {demo.model_dir.parent}.")
    rewards = resolve_rewards(script_args.reward_funcs, script_args.reward_model_name_or_path)
    source = script_args.dataset_name or str(demo.prompts_file)
    load = dict(dataset_config=script_args.dataset_config, max_samples=script_args.max_samples,
                invalid=script_args.invalid)
    train, report = load_prompts(source, split=script_args.dataset_train_split, **load)
    print(f"Train prompts: {report.summary()}")
    held_out = None
    test_split = eval_split(config, script_args)  # as TRL's script: read when eval_strategy is not "no"
    if test_split is not None:
        held_out, eval_report = load_prompts(source, split=test_split, **load)
        print(f"Held-out prompts: {eval_report.summary()}")

    name = model_args.model_name_or_path or str(demo.model_dir)
    tokenizer = load_tokenizer(name, trust_remote_code=config.trust_remote_code, revision=load_kwargs.get("revision"))
    model = load_causal_lm(name, model_init_kwargs=load_kwargs)
    params = sum(p.numel() for p in model.parameters())
    print(f"Model: {name} ({type(model).__name__}, {params / 1e6:.2f}M parameters); {len(train)} prompts x "
          f"{config.num_generations} completions; output: {config.output_dir}", flush=True)
    with _without_trl_instance_warning(trainer_class):
        trainer = trainer_class(model=model, reward_funcs=rewards, args=config, train_dataset=train,
                                eval_dataset=held_out, processing_class=tokenizer, peft_config=peft_config,
                                callbacks=[_reward_callback()])
    if script_args.ignore_bias_buffers:
        from prefixdpo.training.model_setup import ignore_bool_buffers_in_ddp

        ignore_bool_buffers_in_ddp(trainer.model)  # before `train` wraps the model in DDP, as TRL's DPO script
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model(config.output_dir)

    logged = [h for h in trainer.state.log_history if "reward" in h and "eval_reward" not in h]
    print()
    if logged:
        saved = [h["prefix_sharing/tokens_saved"] for h in logged if "prefix_sharing/tokens_saved" in h]
        print(f"Reward: {_fmt(logged[0]['reward'])} over the first logged steps -> {_fmt(logged[-1]['reward'])} "
              f"over the last (logged every {config.logging_steps} steps)")
        if saved:
            print(f"Prefix sharing: the log-prob passes ran {sum(saved) / len(saved):.1%} fewer tokens than TRL's "
                  "rows hold (padding not counted)")
    if held_out is not None:
        metrics = trainer.evaluate()
        print(f"Held-out reward (eval_reward): {_fmt(metrics.get('eval_reward'))} on {len(held_out)} prompts")
    print(f"Model saved to {os.path.abspath(config.output_dir)} ({time.time() - start:.0f} s)")
    sys.stdout.flush()
    return 0
