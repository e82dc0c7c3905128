"""Reward models (Bradley-Terry, as TRL's `RewardTrainer`) trained on prefix-shared rows: one pass scores
every response of a prompt. The public names are `prefixdpo.PrefixRewardConfig` / `PrefixRewardTrainer`."""
