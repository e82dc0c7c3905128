"""`prefixdpo train [config.yaml] [--model M] [--dataset D] [--output-dir DIR] [--any-config-option V ...]`.

Without `--model` the model is the embedded default (a small Llama built locally, `prefixdpo.demo`);
without `--dataset` the data is the default's generated preference set. With neither, the run uses
hyper-parameters suited to that random-init model (any of them can still be overridden); this is what
`make demo` runs. Every other option is a `PrefixDPOConfig` / `DPOModelArguments` / `DataArguments` field
(TRL's `DPOConfig`, `ModelConfig` and `ScriptArguments` names: a `trl dpo` command runs as `prefixdpo train`),
spelled with dashes or underscores, from the YAML file or the command line (command line wins).
Every boolean option X also takes `--X true|false` and `--no_X`; an option whose default is None
takes `none` (e.g. `--max_length none`). LoRA adapters train exactly when `--use_peft` is given, with
TRL's `--lora_*` options (`--lora_r` alone changes nothing, as in TRL: a warning says so); QLoRA adds
`--load_in_4bit` (CUDA + bitsandbytes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixdpo.errors import UserError

# Hyper-parameters for the embedded default's random-init model; each applies only when neither the
# YAML file nor the command line sets it. DPO from random init sits near chance for ~50-100 steps
# before the policy learns to read the instruction, so: a large constant learning rate, no gradient
# clipping (clipping at 1.0 roughly halved progress in the measured runs), two epochs (250 steps).
# TRL's defaults of gradient checkpointing (on) and bf16 (on where supported) are turned off: the tiny
# model needs no memory saving, and fp32 keeps the demo's numbers the same on every device.
DEMO_DEFAULTS: dict[str, str] = {
    "output_dir": "prefixdpo-output/demo",  # under the git-ignored default output folder
    "learning_rate": "2e-3",
    "lr_scheduler_type": "constant",
    "max_grad_norm": "0",
    "num_train_epochs": "2",
    "per_device_train_batch_size": "16",
    "per_device_eval_batch_size": "50",
    "logging_steps": "25",
    "save_strategy": "no",
    "seed": "0",
    "gradient_checkpointing": "false",
    "bf16": "false",
}

NO_HELD_OUT = "No held-out split (set --eval_strategy steps or epoch to evaluate on --dataset_test_split, as TRL)"

USAGE = "prefixdpo train [config.yaml] [--model NAME_OR_PATH] [--dataset NAME_OR_PATH] [--output-dir DIR] [--OPTION VALUE ...]"


def register(subparsers) -> None:
    # No options declared here: `prefixdpo.cli` hands every argument after `train` to us unparsed
    # (`pass_through`), and `parse_train_args` knows the hundred-odd config options.
    p = subparsers.add_parser(
        "train", add_help=False, usage=USAGE,
        help="DPO-family training with prefix sharing (no arguments: the embedded demo)",
    )
    p.set_defaults(func=run, pass_through=True)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Option defaults shown, the description printed as written."""


PARSER_KWARGS = {"prog": "prefixdpo train", "usage": USAGE, "description": __doc__,
                 "formatter_class": HelpFormatter}


def format_metric(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


@dataclass
class ScriptSetup:
    """What a training command parsed from its arguments: its three option dataclasses, and TRL's PEFT config and
    `from_pretrained` keyword arguments built from the model options (refused in one line where unusable)."""

    config: Any
    model_args: Any
    data_args: Any
    peft_config: Any
    load_kwargs: dict


def script_setup(argv: list[str], option_types, parser_kwargs: dict, parse: Callable[[list[str]], tuple]
                 ) -> ScriptSetup | None:
    """A training command's `[config.yaml] [--X v]` parsed by `parse` into its `option_types`; None after printing
    `--help`. Options without effect are stated (TRL's) or refused (ours) here, before any work."""
    from prefixdpo.option_parser import OptionParser
    from prefixdpo.training.options import script_options_without_effect, state_options_without_effect

    if any(a in ("-h", "--help") for a in argv):
        OptionParser(option_types, **parser_kwargs).print_help()
        return None
    config, model_args, data_args = parse(argv)
    state_options_without_effect(script_options_without_effect(config, data_args)
                                 + model_args.options_without_effect_in(config))
    return ScriptSetup(config, model_args, data_args, peft_config=model_args.peft_config(),
                       load_kwargs=model_args.from_pretrained_kwargs(config.model_init_kwargs,
                                                                     config.trust_remote_code,
                                                                     config.local_process_index))


def print_group_reports(trainer) -> None:
    """One line per dataset the trainer grouped by prompt (`--group_by_prompt true`)."""
    for name, report in trainer.group_reports.items():
        print(f"{'Train' if name == 'train' else 'Held-out'} data: {report.summary()}")


def parse_train_args(argv: list[str], demo_defaults: dict[str, str] | None = None) -> tuple:
    """`prefixdpo train`'s options: (PrefixDPOConfig, DPOModelArguments, DataArguments) from `[config.yaml] [--X v]`."""
    from prefixdpo.dpo.config import DPO_OPTIONS
    from prefixdpo.option_parser import parse_options

    return parse_options(DPO_OPTIONS, argv, demo_defaults=demo_defaults, **PARSER_KWARGS)


def run(args) -> int:
    from prefixdpo.dpo.config import DPO_OPTIONS, data_options

    setup = script_setup(list(getattr(args, "extra_argv", [])), DPO_OPTIONS, PARSER_KWARGS,
                         parse=lambda argv: parse_train_args(argv, demo_defaults=DEMO_DEFAULTS))
    if setup is None:
        return 0
    config, model_args, data_args = setup.config, setup.model_args, setup.data_args
    peft_config, load_kwargs = setup.peft_config, setup.load_kwargs  # TRL's own PEFT and quantization configs
    demo_model = model_args.model_name_or_path is None
    demo_data = data_args.dataset_name is None

    from prefixdpo.data.prepare import prepare_examples
    from prefixdpo.core.models import load_causal_lm, load_tokenizer
    from prefixdpo.dpo.trainer import PrefixDPOTrainer

    start = time.time()
    demo = None
    if demo_model or demo_data:
        from prefixdpo.demo import build_demo_for_run

        demo = build_demo_for_run(os.path.join(config.output_dir, "demo-base"), config)
        print(f"Embedded default built in {demo.model_dir.parent} "
              f"({'model' if demo_model else ''}{' and ' if demo_model and demo_data else ''}{'data' if demo_data else ''}).")
    if demo_model:
        model_args.model_name_or_path = str(demo.model_dir)
    name = model_args.model_name_or_path
    tokenizer = load_tokenizer(name, trust_remote_code=config.trust_remote_code,
                               revision=load_kwargs.get("revision"))
    model = load_causal_lm(name, model_init_kwargs=load_kwargs)
    ref_model = None
    if model_args.ref_model_name_or_path is not None:  # loaded as the model is, as TRL builds its reference
        ref_model = load_causal_lm(model_args.ref_model_name_or_path, model_init_kwargs=load_kwargs)

    options = data_options(config, data_args)
    if demo_data:
        options.split, options.eval_split = "train", "test"
        source = {"train": str(demo.train_file), "test": str(demo.eval_file)}
    else:
        source = data_args.dataset_name
    prepared = prepare_examples(source, tokenizer, options)
    print(f"Train data: {prepared.report.summary()}")
    if prepared.eval_report is not None:
        print(f"Held-out data: {prepared.eval_report.summary()}")
    if not prepared.examples:
        raise UserError(f"no usable training examples ({prepared.report.summary()})")

    params = sum(p.numel() for p in model.parameters())
    print(f"Model: {model_args.model_name_or_path} ({type(model).__name__}, {params / 1e6:.2f}M parameters); "
          f"{len(prepared.examples)} training pairs; output: {config.output_dir}", flush=True)
    trainer = PrefixDPOTrainer(
        model=model,
        ref_model=ref_model,
        args=config,
        train_dataset=prepared.examples,
        eval_dataset=prepared.eval_examples or None,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if data_args.ignore_bias_buffers:
        from prefixdpo.training.model_setup import ignore_bool_buffers_in_ddp

        ignore_bool_buffers_in_ddp(trainer.model)  # before `train` wraps the model in DDP, as TRL's script
    print_group_reports(trainer)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model(config.output_dir)

    print()
    print(f"Engine: {trainer.engine_description}")
    if trainer._train_micro is not None and trainer._train_micro.tree_plan is not None:
        print(f"Train data: {trainer._train_micro.tree_plan.summary()}")
    if prepared.eval_examples:
        metrics = trainer.evaluate()
        accuracy = metrics.get("eval_rewards/accuracies")
        print(f"Held-out reward accuracy (eval_rewards/accuracies): {format_metric(accuracy)} "
              f"on {len(prepared.eval_examples)} pairs; eval_loss {format_metric(metrics.get('eval_loss'))}")
    else:
        logged = [h for h in trainer.state.log_history if "rewards/accuracies" in h]
        last = logged[-1]["rewards/accuracies"] if logged else None
        print(f"{NO_HELD_OUT}; last training reward accuracy: {format_metric(last)}")
    print(f"Model saved to {os.path.abspath(config.output_dir)} ({time.time() - start:.0f} s)")
    sys.stdout.flush()
    return 0
