"""The recipe every training command follows (`train`, `reward`, `grpo`, `rloo`), once; each command gives its hooks.

    options  -> `[config.yaml] [--option value ...]` parsed into the command's option dataclasses (`--help` prints
                them); options without effect stated (TRL's) or refused (ours); TRL's PEFT and `from_pretrained`
                configs built from the model options, before any work
    defaults -> the embedded default (`prefixdpo_tools.demo*`) built where no model or no dataset is named
    inputs   -> the model, its tokenizer, the training and held-out data (`load`: in the command's order, each
                data report printed)
    trainer  -> built from them (`make_trainer`); `--ignore_bias_buffers` applied before `train` wraps the model
    train    -> `trainer.train(resume_from_checkpoint=...)`, then the model exported to output_dir
    report   -> what the run did (`report`), then where the model went and how long it took

Command modules import this and nothing heavy at module level: `prefixdpo --help` imports every command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

NO_HELD_OUT = "No held-out split (set --eval_strategy steps or epoch to evaluate on --dataset_test_split, as TRL)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Option defaults shown, the description printed as written."""


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

    @property
    def needs_default(self) -> bool:
        """Whether the embedded default is built: no model or no dataset named."""
        return self.model_args.model_name_or_path is None or self.data_args.dataset_name is None


@dataclass
class Inputs:
    """What a recipe loaded: the model under `name`, its tokenizer, the training data and the held-out data (None
    where there is none), and `extra`: what the command's hooks pass on (a reference model, reward functions)."""

    name: str
    model: Any
    tokenizer: Any
    train: Any
    held_out: Any = None
    extra: Any = None


class Recipe:
    """A training command: the skeleton (`run`) over the hooks a command gives (a subclass), set up per command (an
    instance of it):

    command: the sub-command's name; summary: its line in `prefixdpo --help`; description: its `--help` text;
    demo_defaults: option -> value where neither the YAML file nor the command line sets it and neither names a
    model or a dataset; options_at: (module, name) of its option dataclasses' tuple, imported when the command runs;
    saved: what the run trains ("Model", "Reward model"), in its model and saved lines; usage_options: the options
    the usage line names between the dataset and the output folder."""

    command: str
    summary: str
    description: str
    demo_defaults: dict
    options_at: tuple[str, str]
    saved = "Model"
    usage_options = ""

    # ---- the command line

    @property
    def usage(self) -> str:
        return (f"prefixdpo {self.command} [config.yaml] [--model NAME_OR_PATH] [--dataset NAME_OR_PATH] "
                f"{self.usage_options}[--output-dir DIR] [--OPTION VALUE ...]")

    def parser_kwargs(self) -> dict:
        """What `OptionParser` takes besides the dataclasses: the help's program, usage and description."""
        return {"prog": f"prefixdpo {self.command}", "usage": self.usage, "description": self.description,
                "formatter_class": HelpFormatter}

    def register(self, subparsers) -> None:
        # No options declared here: `prefixdpo.cli` hands every argument after the command to `run` unparsed
        # (`pass_through`), and the option dataclasses know the hundred-odd config options.
        p = subparsers.add_parser(self.command, add_help=False, usage=self.usage, help=self.summary)
        p.set_defaults(func=self.run, pass_through=True)

    def option_types(self) -> tuple:
        """The option dataclasses: (config, model arguments, data/script arguments)."""
        module, name = self.options_at
        return getattr(importlib.import_module(module), name)

    def parse(self, argv: list[str], demo_defaults: dict | None = None) -> tuple:
        """(config, model_args, data_args) from `[config.yaml] [--X v]`: the command line over the YAML file, and
        `demo_defaults` where neither sets an option and neither names a model or a dataset."""
        from prefixdpo.commands.options import parse_options

        return parse_options(self.option_types(), argv, demo_defaults=demo_defaults, **self.parser_kwargs())

    def parse_run(self, argv: list[str]) -> tuple:
        """What a run parses: `parse` with the command's demo defaults."""
        return self.parse(argv, self.demo_defaults)

    def setup(self, argv: list[str]) -> ScriptSetup | None:
        """The command's options parsed (see the module doc); None after printing `--help`."""
        from prefixdpo.commands.options import OptionParser
        from prefixdpo.training.options import script_options_without_effect, state_options_without_effect

        if any(a in ("-h", "--help") for a in argv):
            OptionParser(self.option_types(), **self.parser_kwargs()).print_help()
            return None
        config, model_args, data_args = self.parse_run(argv)
        state_options_without_effect(script_options_without_effect(config, data_args)
                                     + model_args.options_without_effect_in(config))
        return ScriptSetup(config, model_args, data_args, peft_config=model_args.peft_config(),
                           load_kwargs=model_args.from_pretrained_kwargs(config.model_init_kwargs,
                                                                         config.trust_remote_code,
                                                                         config.local_process_index))

    # ---- the hooks of a command

    def build_default(self, setup: ScriptSetup):
        """Build the embedded default for this run (the paths of its model and data); print where."""
        raise NotImplementedError

    def load(self, setup: ScriptSetup, default) -> Inputs:
        """The model, its tokenizer and the data (`default`: the embedded default, or None), data reports printed."""
        raise NotImplementedError

    def data_size(self, setup: ScriptSetup, inputs: Inputs) -> str:
        """How much training data, in the model line ("2000 training pairs")."""
        raise NotImplementedError

    def make_trainer(self, setup: ScriptSetup, inputs: Inputs):
        raise NotImplementedError

    def before_train(self, trainer) -> None:
        """What the command prints once the trainer is built."""

    def report(self, setup: ScriptSetup, inputs: Inputs, trainer) -> None:
        """What the run did, after training and the export."""
        raise NotImplementedError

    # ---- shared by the hooks

    @staticmethod
    def load_tokenizer(setup: ScriptSetup, name: str):
        from prefixdpo.core.models import load_tokenizer

        return load_tokenizer(name, trust_remote_code=setup.config.trust_remote_code,
                              revision=setup.load_kwargs.get("revision"))

    def model_line(self, setup: ScriptSetup, inputs: Inputs) -> str:
        params = sum(p.numel() for p in inputs.model.parameters())
        return (f"{self.saved}: {inputs.name} ({type(inputs.model).__name__}, {params / 1e6:.2f}M parameters); "
                f"{self.data_size(setup, inputs)}; output: {setup.config.output_dir}")

    @staticmethod
    def report_over_budget(setup: ScriptSetup) -> None:
        """With prefix reuse: the passes that held more than max_tokens_per_pass, if any (`reuse_plan.OverBudget`)."""
        if getattr(setup.config, "prefix_reuse", False):
            from prefixdpo.core.attention.reuse_plan import OVER_BUDGET

            summary = OVER_BUDGET.summary()
            if summary:
                print(summary)

    # ---- the skeleton

    def run(self, args) -> int:
        setup = self.setup(list(getattr(args, "extra_argv", [])))
        if setup is None:
            return 0
        start = time.time()
        default = self.build_default(setup) if setup.needs_default else None
        inputs = self.load(setup, default)
        print(self.model_line(setup, inputs), flush=True)
        trainer = self.make_trainer(setup, inputs)
        if setup.data_args.ignore_bias_buffers:
            from prefixdpo.training.model_setup import ignore_bool_buffers_in_ddp

            ignore_bool_buffers_in_ddp(trainer.model)  # before `train` wraps the model in DDP, as TRL's scripts
        self.before_train(trainer)
        trainer.train(resume_from_checkpoint=setup.config.resume_from_checkpoint)
        trainer.save_model(setup.config.output_dir)
        print()
        self.report(setup, inputs, trainer)
        self.report_over_budget(setup)
        print(f"{self.saved} saved to {os.path.abspath(setup.config.output_dir)} ({time.time() - start:.0f} s)")
        sys.stdout.flush()
        return 0


class PreferenceRecipe(Recipe):
    """The recipe of the pair trainers (`train`, `reward`): the embedded default is the DPO demo's model and
    rule-following data, records grouped by prompt are reported, and the report names the engine, then the
    held-out metrics or the last training one."""

    def __init__(self, command: str, summary: str, *, description: str, demo_defaults: dict,
                 options_at: tuple[str, str], train_metric: tuple[str, str], saved: str = "Model"):
        """train_metric: (the logged key, its name in the no-held-out line); the rest: see `Recipe`."""
        self.command, self.summary, self.description, self.demo_defaults = command, summary, description, demo_defaults
        self.options_at, self.train_metric, self.saved = options_at, train_metric, saved

    def build_default(self, setup: ScriptSetup):
        from prefixdpo_tools.demo import build_demo_for_run

        demo = build_demo_for_run(os.path.join(setup.config.output_dir, "demo-base"), setup.config)
        print(self.default_line(setup, demo))
        return demo

    def default_line(self, setup: ScriptSetup, demo) -> str:
        return f"Embedded default built in {demo.model_dir.parent}."

    @staticmethod
    def default_data(options, demo) -> dict:
        """The embedded default's data as the dataset: its train and test splits."""
        options.split, options.eval_split = "train", "test"
        return {"train": str(demo.train_file), "test": str(demo.eval_file)}

    def before_train(self, trainer) -> None:
        """One line per dataset the trainer grouped by prompt (`--group_by_prompt true`)."""
        for name, report in trainer.group_reports.items():
            print(f"{'Train' if name == 'train' else 'Held-out'} data: {report.summary()}")

    def report(self, setup: ScriptSetup, inputs: Inputs, trainer) -> None:
        print(f"Engine: {trainer.engine_description}")
        self.report_data(trainer)
        if inputs.held_out:
            print(self.held_out_line(trainer.evaluate(), inputs))
        else:
            key, name = self.train_metric
            logged = [h for h in trainer.state.log_history if key in h]
            print(f"{NO_HELD_OUT}; last training {name}: {format_metric(logged[-1][key] if logged else None)}")

    def report_data(self, trainer) -> None:
        """Lines on how the training data ran (after the engine line)."""

    def held_out_line(self, metrics: dict, inputs: Inputs) -> str:
        raise NotImplementedError
