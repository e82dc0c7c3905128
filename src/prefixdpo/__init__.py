"""prefixdpo: exact, fast preference tuning (the DPO family, reward models) and group RL of Hugging Face causal
LMs by prefix sharing.

The prompt and all its responses run as one row; an attention rule keeps each response from seeing the others,
so per-response log-probs equal those of separate `[prompt][response]` passes. The public face is TRL's:

    from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer        # as: from trl import DPOConfig, DPOTrainer
    from prefixdpo import PrefixRewardConfig, PrefixRewardTrainer  # as: from trl import RewardConfig, RewardTrainer
    from prefixdpo import PrefixGRPOConfig, PrefixGRPOTrainer      # as: from trl import GRPOConfig, GRPOTrainer
    from prefixdpo import PrefixRLOOConfig, PrefixRLOOTrainer      # as: from trl import RLOOConfig, RLOOTrainer

These names are loaded on first use (PEP 562): importing a trainer imports transformers' Trainer and its
integrations (about 9 s of CPU here; the GRPO/RLOO names import TRL too), which `import prefixdpo.data` and the
light commands (inspect, --help) do not need.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "PrefixDPOConfig": "prefixdpo.dpo.config",
    "PrefixDPOTrainer": "prefixdpo.dpo.trainer",
    "PrefixRewardConfig": "prefixdpo.reward.config",
    "PrefixRewardTrainer": "prefixdpo.reward.trainer",
    "PrefixGRPOConfig": "prefixdpo.grpo.config",
    "PrefixGRPOTrainer": "prefixdpo.grpo.trainer",
    "PrefixRLOOConfig": "prefixdpo.grpo.config",
    "PrefixRLOOTrainer": "prefixdpo.grpo.trainer",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
