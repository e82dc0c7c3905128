"""`prefixdpo reward [config.yaml] [--model M] [--dataset D] [--output-dir DIR] [--any-config-option V ...]`:
train a Bradley-Terry reward model (TRL's `RewardTrainer`) with prefix sharing.

The model is any decoder checkpoint, loaded as an `AutoModelForSequenceClassification` with one label
(a causal LM gets a new score head, as TRL does); the data is any preference dataset `prefixdpo train`
reads (standard, conversational, implicit prompt, multi-response with a pairs policy), with an optional
`margin` column. Without `--model` and `--dataset`: the embedded default (the DPO demo's locally built
model and rule-following data), with hyper-parameters suited to it (`make demo-reward`). Every other option
is a `PrefixRewardConfig` / `RewardModelArguments` / `RewardDataArguments` field (TRL's `RewardConfig`,
`ModelConfig` and `ScriptArguments` names: a `trl reward` command runs as `prefixdpo reward`), spelled with
dashes or underscores, from the YAML file or the command line (command line wins). LoRA adapters train
exactly when `--use_peft` is given, for sequence classification (`--lora_task_type SEQ_CLS`, the default
here: the score head trains fully); QLoRA adds `--load_in_4bit` (CUDA + bitsandbytes).
"""

from __future__ import annotations

import os
import sys
import time

from prefixdpo.commands.train import DEMO_DEFAULTS as TRAIN_DEMO_DEFAULTS
from prefixdpo.commands.train import NO_HELD_OUT, format_metric, print_group_reports, script_setup

# For the embedded default's random-init model (each only where neither the YAML file nor the command line
# sets it). A reward model must carry the rule to one token (the score is read at the response's last token),
# so it learns slower than DPO's per-token log-probs: measured on the demo data, held-out accuracy 0.70 after
# 100 steps, 0.96 after 150 and 0.98-1.0 from 200 at a constant 1e-3 (2e-3 stalled near 0.7, 5e-3 did not learn).
DEMO_DEFAULTS: dict[str, str] = {
    **TRAIN_DEMO_DEFAULTS,  # constant schedule, no clipping, 2 epochs of batch 16, seed 0, fp32, no checkpointing
    "output_dir": "prefixdpo-output/demo-reward",
    "learning_rate": "1e-3",
    "num_train_epochs": "2",
}

USAGE = "prefixdpo reward [config.yaml] [--model NAME_OR_PATH] [--dataset NAME_OR_PATH] [--output-dir DIR] [--OPTION VALUE ...]"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "reward", add_help=False, usage=USAGE,
        help="reward-model (Bradley-Terry) training with prefix sharing (no arguments: the embedded demo)",
    )
    p.set_defaults(func=run, pass_through=True)


def _parser_kwargs() -> dict:
    from prefixdpo.commands.train import HelpFormatter

    return {"prog": "prefixdpo reward", "usage": USAGE, "description": __doc__, "formatter_class": HelpFormatter}


def parse_reward_args(argv: list[str], demo_defaults: dict[str, str] | None = None) -> tuple:
    """`prefixdpo reward`'s options: (PrefixRewardConfig, RewardModelArguments, RewardDataArguments)."""
    from prefixdpo.option_parser import parse_options
    from prefixdpo.reward.config import REWARD_OPTIONS

    return parse_options(REWARD_OPTIONS, argv, demo_defaults=demo_defaults, **_parser_kwargs())


def run(args) -> int:
    from prefixdpo.reward.config import REWARD_OPTIONS, reward_data_options

    setup = script_setup(list(getattr(args, "extra_argv", [])), REWARD_OPTIONS, _parser_kwargs(),
                         parse=lambda argv: parse_reward_args(argv, demo_defaults=DEMO_DEFAULTS))
    if setup is None:
        return 0
    config, model_args, data_args = setup.config, setup.model_args, setup.data_args
    # TRL's own PEFT (task SEQ_CLS: the score head trains fully) and quantization configs
    peft_config, load_kwargs = setup.peft_config, setup.load_kwargs

    from prefixdpo.core.models import load_tokenizer
    from prefixdpo.reward.data import reward_examples
    from prefixdpo.reward.model import load_reward_model
    from prefixdpo.reward.trainer import PrefixRewardTrainer

    start = time.time()
    demo = None
    if model_args.model_name_or_path is None or data_args.dataset_name is None:
        from prefixdpo.demo import build_demo_for_run

        demo = build_demo_for_run(os.path.join(config.output_dir, "demo-base"), config)
        print(f"Embedded default built in {demo.model_dir.parent}.")
    name = model_args.model_name_or_path or str(demo.model_dir)
    tokenizer = load_tokenizer(name, trust_remote_code=config.trust_remote_code,
                               revision=load_kwargs.get("revision"))
    model = load_reward_model(name, model_init_kwargs=load_kwargs, seed=config.seed)

    options = reward_data_options(config, data_args)
    source = data_args.dataset_name
    if source is None:
        options.split, options.eval_split = "train", "test"
        source = {"train": str(demo.train_file), "test": str(demo.eval_file)}
    reports: dict = {}
    train = reward_examples(source, tokenizer, options, "train", reports)
    print(f"Train data: {reports['train'].summary()}")
    held_out = None
    if options.eval_split is not None:
        options.split = options.eval_split
        held_out = reward_examples(source, tokenizer, options, "eval", reports)
        print(f"Held-out data: {reports['eval'].summary()}")

    params = sum(p.numel() for p in model.parameters())
    print(f"Reward model: {name} ({type(model).__name__}, {params / 1e6:.2f}M parameters); {len(train)} training "
          f"examples; output: {config.output_dir}", flush=True)
    trainer = PrefixRewardTrainer(model=model, args=config, train_dataset=train, eval_dataset=held_out,
                                  processing_class=tokenizer, peft_config=peft_config)
    if data_args.ignore_bias_buffers:
        from prefixdpo.training.model_setup import ignore_bool_buffers_in_ddp

        ignore_bool_buffers_in_ddp(trainer.model)  # before `train` wraps the model in DDP, as TRL's scripts
    print_group_reports(trainer)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model(config.output_dir)
    print()
    print(f"Engine: {trainer.engine_description}")
    if held_out:
        metrics = trainer.evaluate()
        print(f"Held-out pairwise accuracy (eval_accuracy): {format_metric(metrics.get('eval_accuracy'))} on "
              f"{sum(len(ex.pairs) for ex in held_out)} pairs; "
              f"eval_loss {format_metric(metrics.get('eval_loss'))}; eval_margin {format_metric(metrics.get('eval_margin'))}")
    else:
        logged = [h for h in trainer.state.log_history if "accuracy" in h]
        print(f"{NO_HELD_OUT}; last training accuracy: {format_metric(logged[-1]['accuracy'] if logged else None)}")
    print(f"Reward model saved to {os.path.abspath(config.output_dir)} ({time.time() - start:.0f} s)")
    sys.stdout.flush()
    return 0
