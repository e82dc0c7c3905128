"""Attention backends for prefix-shared lines, as one named transformers attention implementation.

`ATTENTION_NAME` is registered with `transformers.AttentionInterface`, so every model that supports
sdpa/flex runs it without per-architecture patches. A prefixdpo pass hands the model its plan as one keyword,
`model(..., pass_plan=plan)` (`pass_plan.PassPlan`), which transformers passes down to the attention function; the
plan's `backend` picks the entry of `ATTENTION`, the dispatch table: dense-mask SDPA, FlexAttention over a BlockMask,
segmented SDPA, FlashAttention varlen, or decoding over prompts held once (`shared_prompt`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from prefixdpo.core.attention import varlen
from prefixdpo.core.attention.flex_compile import allow_flex_recompiles
from prefixdpo.core.attention.pass_plan import SHARED_PROMPT, PassPlan, plan_mask
from prefixdpo.core.attention.segments import segmented_attention
from prefixdpo.core.attention.shared_prompt import shared_prompt_attention
from prefixdpo.core.attention.sinks import has_sinks, sink_attention
from prefixdpo.errors import ConfigError

ATTENTION_NAME = "prefixdpo"
BACKENDS = ("auto", "sdpa", "flex", "segmented", "varlen")
# the backends that slide a layer's window over a prefix-shared line (`pass_plan.plan_mask`, `segments._group_mask`,
# varlen's `window_size` where its kernel takes one: torch >= 2.13); elsewhere a sequence must fit in the window
# (`model_checks.check_sequences_fit_window`)
WINDOWED_BACKENDS = ("sdpa", "flex", "segmented") + (("varlen",) if varlen.slides_windows() else ())


def _is_block_mask(mask) -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(mask, BlockMask)


def _needs_plan(mask, query, key) -> bool:
    """Whether `mask` (what the attention got without a plan) covers other columns than query [B,H,Lq,D] and key
    [B,Hkv,Lk,D]: it then belongs to a pass only its plan runs (module docstring of `pass_plan`)."""
    if mask is None:
        return False
    lengths = tuple(mask.seq_lengths) if _is_block_mask(mask) else tuple(mask.shape[-2:])
    return lengths != (query.shape[2], key.shape[2]) and not (lengths[0] == 1 and lengths[1] == key.shape[2])


def _model_name(module) -> str:
    """The model an attention module belongs to, for a message: its config's model_type, else its class."""
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None) or type(module).__name__


def prefix_attention_forward(module, query, key, value, attention_mask, pass_plan: PassPlan | None = None,
                             **kwargs):
    """query [B,H,L,D], key/value [B,Hkv,L,D] -> ([B,L,H,D], None), as `pass_plan` says.

    Without a plan: the mask alone, as a stock attention runs it: `generate` and its prefill (transformers' mask;
    None: causal), or a plain line pass whose model dropped the keyword on the way (its dense mask or BlockMask is the
    rule, whole). A mask that does not fit the query and key columns (a zero-size stand-in, a chunk's mask over a
    cached prefix, a sequence-parallel rank's) is a prefixdpo pass that needs its plan: refused in one line, never
    run. With the plan's `sequence_parallel` (`core.sequence_parallel`): query/key/value hold this rank's l = L / N
    columns; the attention runs on head shards of the whole line between two all-to-alls."""
    if pass_plan is None:
        if _needs_plan(attention_mask, query, key):
            raise ConfigError(f"the model ({_model_name(module)}) does not hand prefixdpo's pass plan (the "
                              "`pass_plan` keyword) to its attention, so prefix-shared lines cannot run on it: "
                              "use --prefix_sharing false")
        if _is_block_mask(attention_mask):
            return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    if pass_plan.sequence_parallel is not None:
        return pass_plan.sequence_parallel.attend(_line_attention, module, query, key, value, pass_plan, **kwargs)
    return _line_attention(module, query, key, value, pass_plan, attention_mask=attention_mask, **kwargs)


def _line_attention(module, query, key, value, plan: PassPlan, attention_mask=None, **kwargs):
    """`prefix_attention_forward` over whole lines: query [B,H,L,D], key/value [B,Hkv,L,D] -> ([B,L,H,D], None).
    A plan with a cached prefix store (`prefix_kv`, prefix reuse) records this layer's keys and values, or puts the
    prefix's before them. attention_mask: transformers' (read by decoding only; a line pass's is the plan's)."""
    if plan.prefix_kv is not None:
        key, value = plan.prefix_kv.keys_values(module, key, value)
    return ATTENTION[plan.backend](module, query, key, value, plan, attention_mask, **kwargs)


def _sdpa(module, query, key, value, mask, **kwargs):
    """transformers' SDPA over a bool mask (None: causal)."""
    if mask is None:
        kwargs.setdefault("is_causal", True)
    else:
        kwargs["is_causal"] = False
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def _sliding_window(kwargs: dict) -> int | None:
    """The window of a sliding layer's attention call (None: a full-attention layer)."""
    return int(kwargs["sliding_window"]) if kwargs.get("sliding_window") else None


def _dense(module, query, key, value, plan: PassPlan, attention_mask=None, **kwargs):
    """The sdpa backend: the plan's dense bool [B, 1, L, Lk] mask, under the layer's sliding window where it has one
    (`pass_plan.plan_mask`); a layer with attention sinks runs its model's own eager attention over it as an additive
    mask (`sinks`)."""
    window = _sliding_window(kwargs)
    if has_sinks(kwargs):
        return sink_attention(module, query, key, value, plan_mask(plan, window, additive=query.dtype), **kwargs)
    return _sdpa(module, query, key, value, plan_mask(plan, window), **kwargs)


def _flex(module, query, key, value, plan: PassPlan, attention_mask=None, **kwargs):
    """The flex backend: FlexAttention over the plan's BlockMask, or its windowed one for a sliding layer
    (`pass_plan.plan_mask`)."""
    return flex_attention_forward(module, query, key, value, plan_mask(plan, _sliding_window(kwargs)), **kwargs)


def _refuse_features(kwargs: dict, backend: str, instead: str, features=("softcap", "s_aux", "sinks")) -> None:
    for feature in features:
        if kwargs.get(feature) is not None:
            raise ValueError(f"{backend} attention does not support '{feature}'; use {instead}")


def _segmented(module, query, key, value, plan: PassPlan, attention_mask=None, **kwargs):
    """The segmented backend: SDPA over the allowed blocks of the plan's `SegmentPlan`; a layer with attention sinks
    runs its model's own eager attention per group of segments over the group's additive mask (`sinks`)."""
    _refuse_features(kwargs, "segmented", "the sdpa or flex backend", features=("softcap",))
    dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
    attend = None
    if has_sinks(kwargs):
        def attend(q, k, v, additive_mask):
            return sink_attention(module, q, k, v, additive_mask, **kwargs)[0]
    return segmented_attention(query, key, value, plan.mask, scaling=kwargs.get("scaling"), dropout=dropout,
                               window=_sliding_window(kwargs), attend=attend), None


def _varlen(module, query, key, value, plan: PassPlan, attention_mask=None, **kwargs):
    """The varlen backend: FlashAttention varlen over the plan's `VarlenPlan`."""
    _refuse_features(kwargs, "varlen", "the flex backend")
    if module.training and kwargs.get("dropout", 0.0):
        raise ConfigError(
            f"attention='varlen' has no attention dropout (the model's is {kwargs['dropout']}); "
            "use 'flex' or 'sdpa', or set the model's attention_dropout to 0"
        )
    return varlen.varlen_attention(query, key, value, plan.mask, scaling=kwargs.get("scaling"),
                                   window=_sliding_window(kwargs)), None


def _shared_prompt(module, query, key, value, plan: PassPlan, attention_mask=None, **kwargs):
    """A decoding step over prompts held once (`shared_prompt`): the cascade over the prompt and the rows' own
    columns where it applies, else SDPA over the prompt's keys gathered per row before the own ones; transformers'
    mask of the decoding rows."""
    out, key, value = shared_prompt_attention(plan.shared_prompt, module, key, value, query, attention_mask, kwargs)
    if out is not None:
        return out, None
    return _sdpa(module, query, key, value, attention_mask, **kwargs)


# The attention of each plan backend: (module, query, key, value, plan, attention_mask=transformers', **kwargs).
ATTENTION = {"sdpa": _dense, "flex": _flex, "segmented": _segmented, "varlen": _varlen, SHARED_PROMPT: _shared_prompt}


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
