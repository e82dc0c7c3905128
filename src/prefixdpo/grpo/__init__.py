"""Group RL (TRL's GRPO and RLOO) with each prompt computed once per log-prob pass: its G completions run as
branches after it (see `trainer.py`)."""

from prefixdpo.grpo.config import PrefixGRPOConfig, PrefixRLOOConfig
from prefixdpo.grpo.trainer import PrefixGRPOTrainer, PrefixRLOOTrainer

__all__ = ["PrefixGRPOConfig", "PrefixGRPOTrainer", "PrefixRLOOConfig", "PrefixRLOOTrainer"]
