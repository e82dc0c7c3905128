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

from prefixdpo.commands.recipe import Inputs, PreferenceRecipe, ScriptSetup, format_metric
from prefixdpo.commands.train import DEMO_DEFAULTS as TRAIN_DEMO_DEFAULTS

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


class RewardRecipe(PreferenceRecipe):
    """`prefixdpo reward`: `PrefixRewardTrainer` on preference pairs (see the module doc)."""

    def load(self, setup: ScriptSetup, default) -> Inputs:
        """The reward model (a new score head where the checkpoint is a causal LM, seeded), its tokenizer, and the
        training and held-out examples."""
        from prefixdpo.reward.config import reward_data_options
        from prefixdpo.reward.data import reward_examples
        from prefixdpo.reward.model import load_reward_model

        config, data_args = setup.config, setup.data_args
        name = setup.model_args.model_name_or_path or str(default.model_dir)
        tokenizer = self.load_tokenizer(setup, name)
        model = load_reward_model(name, model_init_kwargs=setup.load_kwargs, seed=config.seed)
        options = reward_data_options(config, data_args)
        source = self.default_data(options, default) if data_args.dataset_name is None else data_args.dataset_name
        reports: dict = {}
        train = reward_examples(source, tokenizer, options, "train", reports)
        print(f"Train data: {reports['train'].summary()}")
        held_out = None
        if options.eval_split is not None:
            options.split = options.eval_split
            held_out = reward_examples(source, tokenizer, options, "eval", reports)
            print(f"Held-out data: {reports['eval'].summary()}")
        return Inputs(name, model, tokenizer, train, held_out)

    def data_size(self, setup: ScriptSetup, inputs: Inputs) -> str:
        return f"{len(inputs.train)} training examples"

    def make_trainer(self, setup: ScriptSetup, inputs: Inputs):
        from prefixdpo.reward.trainer import PrefixRewardTrainer

        # TRL's own PEFT config (task SEQ_CLS: the score head trains fully)
        return PrefixRewardTrainer(model=inputs.model, args=setup.config, train_dataset=inputs.train,
                                   eval_dataset=inputs.held_out, processing_class=inputs.tokenizer,
                                   peft_config=setup.peft_config)

    def held_out_line(self, metrics: dict, inputs: Inputs) -> str:
        return (f"Held-out pairwise accuracy (eval_accuracy): {format_metric(metrics.get('eval_accuracy'))} on "
                f"{sum(len(ex.pairs) for ex in inputs.held_out)} pairs; "
                f"eval_loss {format_metric(metrics.get('eval_loss'))}; "
                f"eval_margin {format_metric(metrics.get('eval_margin'))}")


RECIPE = RewardRecipe("reward", "reward-model (Bradley-Terry) training with prefix sharing (no arguments: the embedded "
                      "demo)", description=__doc__, demo_defaults=DEMO_DEFAULTS,
                      options_at=("prefixdpo.reward.config", "REWARD_OPTIONS"), train_metric=("accuracy", "accuracy"),
                      saved="Reward model")
# (argv, demo_defaults=None) -> (PrefixRewardConfig, RewardModelArguments, RewardDataArguments)
parse_reward_args = RECIPE.parse
register, run = RECIPE.register, RECIPE.run
