"""`prefixdpo grpo` (and, over the same recipe, `prefixdpo rloo`: commands/rloo.py): group RL with TRL 1.16's
trainers, each prompt computed once per log-prob pass. `GroupRecipe` is the recipe both follow (`commands.recipe`):
TRL's config, model and script arguments, the embedded default of `prefixdpo_tools.demo_grpo`, the reward functions
by name, and a report of the reward and the tokens saved. `HELP` is their `--help` text, in each method's words.
"""

from __future__ import annotations

import contextlib
import os

from prefixdpo.commands.recipe import Inputs, Recipe, ScriptSetup

HELP = """\
`prefixdpo {command} [config.yaml] [--model M] [--dataset D] [--reward_funcs F ...] [--any-config-option V ...]`:
{method} (TRL 1.16's `{trainer}`) with each prompt computed once per log-prob pass, its completions as branches.

Options are TRL's `{config}` fields with TRL's names, defaults and meaning (a TRL {method} YAML runs unchanged),
`transformers.TrainingArguments` (schedules, accumulation, bf16, checkpoints, DDP/FSDP/DeepSpeed), TRL's script
names for the data and rewards (`--dataset_name`, `--reward_funcs`, `--reward_model_name_or_path`), TRL's
`ModelConfig` and `ScriptArguments` as `trl {command}` parses them (`--model_revision`, `--dtype`,
`--attn_implementation`, LoRA exactly with `--use_peft` from the `--lora_*` options, QLoRA with `--load_in_4bit`,
`--dataset_test_split` read when `--eval_strategy` is not `no`), and the layout of the passes
(`--prefix_sharing`, `--packing`, `--pack_length`, `--attention`). Records need a `prompt` (text or messages);
their other fields reach the reward functions. Without `--model` and `--dataset`: the embedded default (a tiny
model, prompts sharing a long instruction, the reward `vowel_share`), which prints the reward rising and the tokens
prefix sharing saved (`make demo-{command}`). The YAML file's values are defaults that the command line \
overrides; every
boolean X also takes `--X true|false` and `--no_X`;
`--resume_from_checkpoint latest` resumes from the newest complete checkpoint of this run in output_dir. Runs
survive as `prefixdpo train` runs do: an output_dir of another run is refused (`--overwrite_output_dir true`
replaces it), SIGTERM/SIGUSR1 save a checkpoint after the current step and exit 75 (a first Ctrl-C: the same, exit
130; a second: at once), and a NaN/inf step is never applied (`--nonfinite stop|skip`), nor one whose rewards are all
None/NaN or hold an inf; a reward function that raises or returns anything but one number or None per completion
stops the run in one line (exit 2).
"""

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
    "reward_funcs": ["prefixdpo_tools.demo_grpo:vowel_share"],
}



def parse_group_args(config_class, command: str, argv: list[str] | None = None,
                     demo_defaults: dict[str, str] | None = None, **parser_kwargs):
    """`[config.yaml] [--option value ...]` -> (config, GroupModelArguments, GroupScriptArguments): the command line
    overrides the YAML file; `demo_defaults` apply where neither sets the option and neither names a model or a
    dataset (the embedded default)."""
    from prefixdpo.commands.options import parse_options
    from prefixdpo.grpo.config import group_options

    return parse_options(group_options(config_class), argv, demo_defaults=demo_defaults,
                         **{"prog": f"prefixdpo {command}", **parser_kwargs})


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


class GroupRecipe(Recipe):
    """A group-RL command over one of TRL's trainers: `trainer_name` and `config_name` name ours over it and its
    config in `prefixdpo.grpo` (imported when the command runs: `prefixdpo --help` imports no TRL). Every argument
    after the command is ours to parse (`pass_through`): TRL's config has ~200 options."""

    usage_options = "[--reward_funcs NAME ...] "

    def __init__(self, command: str, summary: str, trainer_name: str, config_name: str):
        self.command, self.summary, self.trainer_name, self.config_name = command, summary, trainer_name, config_name

    def classes(self) -> tuple[type, type]:
        """(trainer class, config class)."""
        import prefixdpo.grpo

        return getattr(prefixdpo.grpo, self.trainer_name), getattr(prefixdpo.grpo, self.config_name)

    @property
    def demo_defaults(self) -> dict[str, str | list[str]]:
        return {**DEMO_DEFAULTS, "output_dir": f"prefixdpo-output/demo-{self.command}"}

    @property
    def description(self) -> str:
        """`HELP` in the words of this command's own classes (TRL's trainer and config under ours)."""
        trainer, config = (next(c.__name__ for c in cls.__mro__ if c.__module__.startswith("trl."))
                           for cls in self.classes())
        return HELP.format(command=self.command, method=trainer.removesuffix("Trainer"), trainer=trainer,
                           config=config)

    def option_types(self) -> tuple:
        from prefixdpo.grpo.config import group_options

        return group_options(self.classes()[1])

    def setup(self, argv: list[str]) -> ScriptSetup | None:
        setup = super().setup(argv)
        if setup is not None:  # as TRL's script: the reference and reward models by name load as the model does
            config = setup.config
            config.model_init_kwargs = setup.model_args.script_model_init_kwargs(config.model_init_kwargs,
                                                                                 config.trust_remote_code)
        return setup

    def build_default(self, setup: ScriptSetup):
        from prefixdpo_tools.demo_grpo import build_group_demo_for_run

        demo = build_group_demo_for_run(os.path.join(setup.config.output_dir, "demo-base"), setup.config)
        print(f"Embedded default built in {demo.model_dir.parent}.")
        return demo

    def load(self, setup: ScriptSetup, default) -> Inputs:
        """The reward functions (a bad name fails first), the prompts (held-out ones where TRL's script reads them:
        eval_strategy not "no"), then the model and its tokenizer."""
        from prefixdpo.core.models import load_causal_lm
        from prefixdpo.grpo.data import load_prompts
        from prefixdpo.grpo.rewards import resolve_rewards
        from prefixdpo.training.options import eval_split

        config, script_args = setup.config, setup.data_args
        rewards = resolve_rewards(script_args.reward_funcs, script_args.reward_model_name_or_path)
        source = script_args.dataset_name or str(default.prompts_file)
        load = dict(dataset_config=script_args.dataset_config, max_samples=script_args.max_samples,
                    invalid=script_args.invalid, max_record_bytes=script_args.max_record_bytes)
        train, report = load_prompts(source, split=script_args.dataset_train_split, **load)
        print(f"Train prompts: {report.summary()}")
        indices = {"train": report.kept_indices}  # messages name records by their index in the source
        held_out = None
        test_split = eval_split(config, script_args)
        if test_split is not None:
            held_out, eval_report = load_prompts(source, split=test_split, **load)
            print(f"Held-out prompts: {eval_report.summary()}")
            indices["eval"] = eval_report.kept_indices
        name = setup.model_args.model_name_or_path or str(default.model_dir)
        tokenizer = self.load_tokenizer(setup, name)
        model = load_causal_lm(name, model_init_kwargs=setup.load_kwargs)
        return Inputs(name, model, tokenizer, train, held_out, extra=(rewards, indices))

    def data_size(self, setup: ScriptSetup, inputs: Inputs) -> str:
        return f"{len(inputs.train)} prompts x {setup.config.num_generations} completions"

    def make_trainer(self, setup: ScriptSetup, inputs: Inputs):
        trainer_class = self.classes()[0]
        with _without_trl_instance_warning(trainer_class):
            rewards, record_indices = inputs.extra
            return trainer_class(model=inputs.model, reward_funcs=rewards, args=setup.config,
                                 record_indices=record_indices,
                                 train_dataset=inputs.train, eval_dataset=inputs.held_out,
                                 processing_class=inputs.tokenizer, peft_config=setup.peft_config,
                                 callbacks=[_reward_callback()])

    def report(self, setup: ScriptSetup, inputs: Inputs, trainer) -> None:
        """The reward over the first and the last logged steps, the tokens prefix sharing saved, the held-out
        reward."""
        logged = [h for h in trainer.state.log_history if "reward" in h and "eval_reward" not in h]
        if logged:
            saved = [h["prefix_sharing/tokens_saved"] for h in logged if "prefix_sharing/tokens_saved" in h]
            print(f"Reward: {_fmt(logged[0]['reward'])} over the first logged steps -> {_fmt(logged[-1]['reward'])} "
                  f"over the last (logged every {setup.config.logging_steps} steps)")
            if saved:
                print(f"Prefix sharing: the log-prob passes ran {sum(saved) / len(saved):.1%} fewer tokens than "
                      "TRL's rows hold (padding not counted)")
        if inputs.held_out is not None:
            metrics = trainer.evaluate()
            print(f"Held-out reward (eval_reward): {_fmt(metrics.get('eval_reward'))} on {len(inputs.held_out)} "
                  "prompts")


RECIPE = GroupRecipe("grpo", "GRPO with prefix sharing (TRL's GRPOTrainer; no arguments: the embedded demo)",
                     trainer_name="PrefixGRPOTrainer", config_name="PrefixGRPOConfig")
register, run = RECIPE.register, RECIPE.run
