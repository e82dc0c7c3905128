"""`prefixdpo rloo`: RLOO (TRL 1.16's `RLOOTrainer`) with prefix sharing: the group recipe of `prefixdpo grpo`
(`commands.grpo.GroupRecipe`: the same options, embedded default and report) over TRL's `RLOOConfig` fields, its
help in RLOO's words."""

from __future__ import annotations

from prefixdpo.commands.grpo import GroupRecipe

RECIPE = GroupRecipe("rloo", "RLOO with prefix sharing (TRL's RLOOTrainer; no arguments: the embedded demo)",
                     trainer_name="PrefixRLOOTrainer", config_name="PrefixRLOOConfig")
register, run = RECIPE.register, RECIPE.run
