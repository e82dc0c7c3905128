"""Attention backends for prefix-shared lines, as one named transformers attention implementation.

`ATTENTION_NAME` is registered with `transformers.AttentionInterface`, so every model that supports
sdpa/flex runs it without per-architecture patches. transformers hands a 4D tensor or a BlockMask given
as `attention_mask=` straight to the attention function, so the backend is chosen by the *mask* we
build (`batch_attention_mask`, from the lines' spans, the one rule of `masks.py`): a BlockMask runs FlexAttention, a
dense boolean `[B,1,L,L]` mask runs SDPA, a zero-size tensor carrying a `prefix_plan` runs segmented SDPA, one
carrying a `varlen_plan` runs FlashAttention varlen.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from prefixdpo.core.attention.masks import block_mask, dense_mask
from prefixdpo.core.attention import varlen
from prefixdpo.core.attention.flex_compile import allow_flex_recompiles
from prefixdpo.core.attention.reuse_plan import plan_reuse
from prefixdpo.core.attention.segments import SegmentPlan, build_segment_plan, segmented_attention
from prefixdpo.core.attention.shared_prompt import shared_prompt_attention
from prefixdpo.errors import ConfigError

ATTENTION_NAME = "prefixdpo"
BACKENDS = ("auto", "sdpa", "flex", "segmented", "varlen")


def segment_plan_mask(plan: SegmentPlan, device) -> torch.Tensor:
    """A zero-size 4D tensor carrying the plan as an attribute.

    transformers passes any 4D tensor given as `attention_mask` unchanged to the attention function
    (and gradient checkpointing re-passes the same object on recompute), so the plan travels with it
    without relying on every model forwarding extra kwargs.
    """
    carrier = torch.empty(plan.batch_size, 1, 0, 0, dtype=torch.bool, device=device)
    carrier.prefix_plan = plan
    return carrier


def _is_block_mask(mask) -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(mask, BlockMask)


def prefix_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """query [B,H,L,D], key/value [B,Hkv,L,D]; attention_mask a BlockMask, a bool [B,1,L,L], or None.

    None happens only outside prefixdpo's forward (e.g. `generate`): plain causal attention then. A mask carrying
    `prefix_kv` (`PrefixKV`, prefix reuse) records this layer's keys and values, or puts a cached prefix's before them.
    A mask carrying `sequence_parallel` (`core.sequence_parallel`): query/key/value hold this rank's l = L / N
    columns; the attention runs on head shards of the whole line (the mask's) between two all-to-alls.
    """
    sp = getattr(attention_mask, "sequence_parallel", None)
    if sp is not None:
        return sp.attend(_line_attention, module, query, key, value, attention_mask, **kwargs)
    return _line_attention(module, query, key, value, attention_mask, **kwargs)


def _line_attention(module, query, key, value, attention_mask, **kwargs):
    """`prefix_attention_forward` over whole lines: query [B,H,L,D], key/value [B,Hkv,L,D] -> ([B,L,H,D], None)."""
    if getattr(key, "shared_prompt", None) is not None:  # decoding over prompts cached once (`shared_prompt`)
        out, key, value = shared_prompt_attention(key, value, query, attention_mask, kwargs)
        if out is not None:
            return out, None
    store = getattr(attention_mask, "prefix_kv", None)
    if store is not None:
        key, value = store.keys_values(module, key, value)
    if attention_mask is not None and _is_block_mask(attention_mask):
        return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
    plan = getattr(attention_mask, "prefix_plan", None)
    if plan is not None:
        for feature in ("softcap", "s_aux", "sinks"):
            if kwargs.get(feature) is not None:
                raise ValueError(f"segmented attention does not support '{feature}'; use the sdpa or flex backend")
        dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
        return segmented_attention(query, key, value, plan, scaling=kwargs.get("scaling"), dropout=dropout), None
    plan = getattr(attention_mask, "varlen_plan", None)
    if plan is not None:
        for feature in ("softcap", "s_aux", "sinks"):
            if kwargs.get(feature) is not None:
                raise ValueError(f"varlen attention does not support '{feature}'; use the flex backend")
        if module.training and kwargs.get("dropout", 0.0):
            raise ConfigError(
                f"attention='varlen' has no attention dropout (the model's is {kwargs['dropout']}); "
                "use 'flex' or 'sdpa', or set the model's attention_dropout to 0"
            )
        return varlen.varlen_attention(query, key, value, plan, scaling=kwargs.get("scaling")), None
    if attention_mask is not None and attention_mask.numel() == 0:
        raise ValueError("a segmented- or varlen-attention mask lost its plan on the way to the attention function")
    if attention_mask is None:
        kwargs.setdefault("is_causal", True)
    else:
        kwargs["is_causal"] = False
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


class PrefixKV:
    """Per-layer keys and values of a cached prefix, travelling with a pass's mask (`prefix_kv`) to every attention
    call, by the attention module's `layer_idx` (`core.prefix_reuse`). `record()`: the prefix's own pass, which keeps
    each layer's key/value [B, Hkv, p, D] (with their autograd graph); `prepended()`: a pass over tokens after the
    prefix, whose keys and values are the prefix's followed by its own. Through prefixdpo's attention rather than
    a transformers cache, so gradient checkpointing (which drops a layer's cache) keeps it."""

    def __init__(self, layers: dict | None = None, recording: bool = True):
        self.layers = {} if layers is None else layers
        self.recording = recording

    def prepended(self) -> "PrefixKV":
        """A store that puts this one's keys and values before a later pass's own (a snapshot: a layer recomputed
        in backward may record again)."""
        return PrefixKV(dict(self.layers), recording=False)

    def keys_values(self, module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ConfigError(f"prefix_reuse needs attention modules with a layer_idx; {type(module).__name__} has "
                              "none: set prefix_reuse false")
        if self.recording:
            self.layers[layer] = (key, value)
            return key, value
        cached_key, cached_value = self.layers[layer]
        return torch.cat([cached_key, key], dim=2), torch.cat([cached_value, value], dim=2)


def with_prefix_kv(mask, store: PrefixKV):
    """`mask` (any backend's) carrying `store` to the attention calls of its pass."""
    mask.prefix_kv = store
    return mask


AttentionInterface.register(ATTENTION_NAME, prefix_attention_forward)
# Passes that are not prefixdpo's (`generate` on left-padded prompts, as GRPO samples) hand the model a 2D padding
# mask: transformers turns it into the SDPA mask our attention then runs, instead of dropping it (a name without a
# mask function gets none, and left padding would be attended).
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def resolve_backend(backend: str, device: torch.device | str, *, needs_grad: bool = True) -> str:
    """`auto` -> flex on CUDA (compiled, block-sparse), dense-mask SDPA elsewhere.

    `segmented` (SDPA over only the allowed blocks) is opt-in on CPU: measured on 2 cores it beats the
    dense mask on long lines (Tulu-like, 2560 tokens: 2.3 s vs 3.0 s attention fwd+bwd) but loses on
    short ones (HH-like, 768 tokens: 0.44 s vs 0.29 s), where per-segment overhead dominates.

    FlexAttention has no backward on CPU (torch 2.13), so flex is refused there for training.
    `varlen` (FlashAttention varlen) runs on CUDA only and is refused elsewhere; `auto` does not pick it
    until it has been measured against flex on a GPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex":
        allow_flex_recompiles()
    if backend == "flex" and device.type == "cpu" and needs_grad:
        raise ValueError("attention backend 'flex' cannot train on CPU (FlexAttention has no CPU backward); use 'sdpa'")
    if backend == "varlen":
        varlen.check_available(device)
    return backend


def batch_attention_mask(lines, backend: str, *, segment_waste: float = 0.25, queries_from: int = 0,
                         max_tokens_per_pass: int | None = None):
    """The mask object of `lines` (a `data.lines.Lines`, or its [B, L, 2] spans) for a resolved backend: the dense
    bool [B, 1, L, L] mask for sdpa, the BlockMask for flex, a plan-carrying tensor for segmented and varlen; one
    rule, over the spans (`masks.py`). segment_waste: the padding a group of segments may add (`segments._group`).
    queries_from: the pass's queries are the columns from there on, its keys the whole line (the first columns are a
    cached prefix's, `core.prefix_reuse`). max_tokens_per_pass: with prefix reuse on, the budget of one pass: a batch
    with a line over it gets its `reuse_plan.PrefixReuse` instead of a mask (its passes build their own masks)."""
    spans = lines if isinstance(lines, torch.Tensor) else lines.spans
    if max_tokens_per_pass is not None:
        reuse = plan_reuse(spans, max_tokens_per_pass, backend, segment_waste)
        if reuse is not None:
            return reuse
    if backend == "varlen":
        return varlen.varlen_plan_mask(varlen.build_varlen_plan(spans, queries_from), spans.device)
    if backend == "segmented":
        plan = build_segment_plan(spans, waste=segment_waste, queries_from=queries_from)
        return segment_plan_mask(plan, spans.device)
    if backend == "flex":
        return block_mask(spans, queries_from=queries_from)
    if backend == "sdpa":
        return dense_mask(spans, queries_from)
    raise ValueError(f"backend {backend!r} is not resolved; call resolve_backend first")

