"""Everything the group-RL package uses from the rest of prefixdpo, in one place.

`prefixdpo.grpo` is a method package: it owns its trainers, options and command, and takes the machinery
that turns tokens into hidden states from the core. Listing those names here keeps the dependency visible
and makes a move of the core (issue 18) a change to this one file.
"""

from __future__ import annotations

from prefixdpo.attention.backends import ATTENTION_NAME, BACKENDS, build_attention_mask, resolve_backend
from prefixdpo.callbacks import latest_checkpoint
from prefixdpo.data.batch import PAD_DOC, bucket_length
from prefixdpo.data.packing import auto_pack_length, plan_packs
from prefixdpo.engines import enable_requested_fsdp, whole_model_state_dict
from prefixdpo.errors import ConfigError, UserError
from prefixdpo.forward import (
    base_model,
    final_hidden_states,
    prepare_model,
    recording_router_logits,
    restore_stock_attention,
    sliding_window_of,
    text_config,
    through_engine,
    unwrap,
)
from prefixdpo.logprobs import UnsupportedModelError

__all__ = [
    "ATTENTION_NAME",
    "BACKENDS",
    "PAD_DOC",
    "ConfigError",
    "UnsupportedModelError",
    "UserError",
    "auto_pack_length",
    "base_model",
    "bucket_length",
    "build_attention_mask",
    "enable_requested_fsdp",
    "final_hidden_states",
    "latest_checkpoint",
    "plan_packs",
    "prepare_model",
    "recording_router_logits",
    "resolve_backend",
    "restore_stock_attention",
    "sliding_window_of",
    "text_config",
    "through_engine",
    "unwrap",
    "whole_model_state_dict",
]
