"""Everything the group-RL package uses from the rest of prefixdpo, in one place.

`prefixdpo.grpo` is a method package: it owns its trainers, options, data checks, demo and command, and takes
from the rest of prefixdpo only what is listed here:
- core: the attention rule and its backends, the engine-wrapped forward and its hidden states, the model checks,
  the MoE router-logit recorder, the engines (FSDP2 on CPU, whole-model export), model/tokenizer loading;
- data: record loading and per-record validation, bin packing, line-length bucketing, the tiny tokenizer;
- `prefixdpo train`'s option parser (its rules for YAML, booleans and errors) and bf16 device rule;
- the DPO demo's model builder and filler sentences; atomic file writes;
- `verify`'s stock-attention switch, and the benchmark's pieces (model shapes, the FLOP model, timing spreads, the
  peak-memory meter, the idle-core rule) for `verify --task grpo` and `bench --task grpo`.
Listing them keeps the dependency visible and makes a move of the core (issue 18) a change to this one file.
"""

from __future__ import annotations

from prefixdpo.atomic_io import TMP_MARK, atomic_write_text, replace_folder
from prefixdpo.attention.backends import ATTENTION_NAME, BACKENDS, build_attention_mask, resolve_backend
from prefixdpo.bench.memory import PeakMemory
from prefixdpo.bench.model import SHAPES, llama_config
from prefixdpo.bench.runner import Spread
from prefixdpo.callbacks import latest_checkpoint
from prefixdpo.config import _device_has_bf16 as device_has_bf16
from prefixdpo.config import _train_argument_parser as train_argument_parser
from prefixdpo.data.batch import PAD_DOC, bucket_length
from prefixdpo.data.loading import load_records
from prefixdpo.data.packing import auto_pack_length, plan_packs
from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
from prefixdpo.data.validation import (
    EMPTY_PROMPT,
    MISSING_FIELD,
    WRONG_TYPE,
    InvalidRecordError,
    SkipLog,
    check_messages,
    check_policy,
    check_text,
    handle,
    is_blank,
)
from prefixdpo.demo import WORDS, DemoSpec
from prefixdpo.demo import _note as note_sentences
from prefixdpo.demo import build_model as build_demo_model
from prefixdpo.engines import enable_requested_fsdp, whole_model_state_dict
from prefixdpo.errors import ConfigError, UserError
from prefixdpo.flops import FlopCount, ModelShape, forward_flops, shared_flop_count, standard_flop_count
from prefixdpo.forward import (
    base_model,
    check_model_supported,
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
from prefixdpo.models import load_causal_lm, load_tokenizer
from prefixdpo.verify import stock_attention, stock_implementation

__all__ = [
    "ATTENTION_NAME",
    "BACKENDS",
    "ConfigError",
    "DemoSpec",
    "EMPTY_PROMPT",
    "FlopCount",
    "InvalidRecordError",
    "MISSING_FIELD",
    "ModelShape",
    "PAD_DOC",
    "PeakMemory",
    "SHAPES",
    "SkipLog",
    "Spread",
    "TMP_MARK",
    "UnsupportedModelError",
    "UserError",
    "WORDS",
    "WRONG_TYPE",
    "atomic_write_text",
    "auto_pack_length",
    "base_model",
    "bucket_length",
    "build_attention_mask",
    "build_demo_model",
    "build_tiny_tokenizer",
    "check_messages",
    "check_model_supported",
    "check_policy",
    "check_text",
    "device_has_bf16",
    "enable_requested_fsdp",
    "final_hidden_states",
    "forward_flops",
    "handle",
    "is_blank",
    "latest_checkpoint",
    "llama_config",
    "load_causal_lm",
    "load_records",
    "load_tokenizer",
    "note_sentences",
    "plan_packs",
    "prepare_model",
    "recording_router_logits",
    "replace_folder",
    "resolve_backend",
    "restore_stock_attention",
    "shared_flop_count",
    "sliding_window_of",
    "standard_flop_count",
    "stock_attention",
    "stock_implementation",
    "text_config",
    "through_engine",
    "train_argument_parser",
    "unwrap",
    "whole_model_state_dict",
]
