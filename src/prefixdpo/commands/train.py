"""`prefixdpo train [config.yaml] [--model M] [--dataset D] [--output-dir DIR] [--any-config-option V ...]`.

Without `--model` the model is the embedded default (a small Llama built locally, `prefixdpo_tools.demo`);
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

from prefixdpo.commands.recipe import Inputs, PreferenceRecipe, ScriptSetup, format_metric
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


class TrainRecipe(PreferenceRecipe):
    """`prefixdpo train`: `PrefixDPOTrainer` on preference pairs (see the module doc)."""

    def parse_run(self, argv: list[str]) -> tuple:
        return parse_train_args(argv, demo_defaults=self.demo_defaults)  # the module's function, which tests replace

    def default_line(self, setup: ScriptSetup, demo) -> str:
        parts = [part for part, missing in (("model", setup.model_args.model_name_or_path is None),
                                            ("data", setup.data_args.dataset_name is None)) if missing]
        return f"Embedded default built in {demo.model_dir.parent} ({' and '.join(parts)})."

    def load(self, setup: ScriptSetup, default) -> Inputs:
        """The policy (and a reference model where one is named, loaded as the policy is, as TRL builds its
        reference), its tokenizer, and the prepared pairs."""
        from prefixdpo.core.models import load_causal_lm
        from prefixdpo.data.prepare import prepare_examples
        from prefixdpo.dpo.config import data_options

        config, model_args, data_args = setup.config, setup.model_args, setup.data_args
        if model_args.model_name_or_path is None:
            model_args.model_name_or_path = str(default.model_dir)
        name = model_args.model_name_or_path
        tokenizer = self.load_tokenizer(setup, name)
        model = load_causal_lm(name, model_init_kwargs=setup.load_kwargs)
        ref_model = None
        if model_args.ref_model_name_or_path is not None:
            ref_model = load_causal_lm(model_args.ref_model_name_or_path, model_init_kwargs=setup.load_kwargs)
        options = data_options(config, data_args)
        source = self.default_data(options, default) if data_args.dataset_name is None else data_args.dataset_name
        prepared = prepare_examples(source, tokenizer, options)
        print(f"Train data: {prepared.report.summary()}")
        if prepared.eval_report is not None:
            print(f"Held-out data: {prepared.eval_report.summary()}")
        if not prepared.examples:
            raise UserError(f"no usable training examples ({prepared.report.summary()})")
        return Inputs(name, model, tokenizer, prepared.examples, prepared.eval_examples or None, extra=ref_model)

    def data_size(self, setup: ScriptSetup, inputs: Inputs) -> str:
        return f"{len(inputs.train)} training pairs"

    def make_trainer(self, setup: ScriptSetup, inputs: Inputs):
        from prefixdpo.dpo.trainer import PrefixDPOTrainer

        return PrefixDPOTrainer(model=inputs.model, ref_model=inputs.extra, args=setup.config,
                                train_dataset=inputs.train, eval_dataset=inputs.held_out,
                                processing_class=inputs.tokenizer, peft_config=setup.peft_config)

    def report_data(self, trainer) -> None:
        if trainer.train_tree_plan is not None:
            print(f"Train data: {trainer.train_tree_plan.summary()}")

    def held_out_line(self, metrics: dict, inputs: Inputs) -> str:
        return (f"Held-out reward accuracy (eval_rewards/accuracies): "
                f"{format_metric(metrics.get('eval_rewards/accuracies'))} on {len(inputs.held_out)} pairs; "
                f"eval_loss {format_metric(metrics.get('eval_loss'))}")


RECIPE = TrainRecipe("train", "DPO-family training with prefix sharing (no arguments: the embedded demo)",
                     description=__doc__, demo_defaults=DEMO_DEFAULTS,
                     options_at=("prefixdpo.dpo.config", "DPO_OPTIONS"),
                     train_metric=("rewards/accuracies", "reward accuracy"))
PARSER_KWARGS = RECIPE.parser_kwargs()
# (argv, demo_defaults=None) -> (PrefixDPOConfig, DPOModelArguments, DataArguments) from `[config.yaml] [--X v]`
parse_train_args = RECIPE.parse
register, run = RECIPE.register, RECIPE.run
