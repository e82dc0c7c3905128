"""Reward models (Bradley-Terry, as TRL's `RewardTrainer`) trained on prefix-shared rows: one pass scores
every response of a prompt. `PrefixRewardTrainer` and `PrefixRewardConfig` are imported lazily, so the
light modules (scores, losses) load without transformers' Trainer."""

from __future__ import annotations

__all__ = ["PrefixRewardConfig", "PrefixRewardTrainer"]


def __getattr__(name: str):
    if name == "PrefixRewardTrainer":
        from prefixdpo.reward.trainer import PrefixRewardTrainer

        return PrefixRewardTrainer
    if name == "PrefixRewardConfig":
        from prefixdpo.reward.config import PrefixRewardConfig

        return PrefixRewardConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
