"""The pass plan: one frozen description of what one forward pass over prefix-shared lines runs.

A plan is built once per micro-batch (`plan_pass`, from the lines' spans, the one rule of `masks.py`) and reaches
prefixdpo's attention function as one keyword, `model(..., pass_plan=plan)` (transformers hands keywords it does not
know down to the attention function, in forward and in gradient checkpointing's recompute alike). It holds:

- `spans` [B, L, 2] long: (tin, tout) of each column of this pass's tokens ((-1, -1) for padding; `data.lines`);
  independent of `position_ids`. A pass whose first `queries_from` key columns are a cached prefix's (a chunk of
  prefix reuse) holds its queries' spans, numbered as the keys' line is; under sequence parallelism, the whole
  lines' (each rank runs its own columns of them, `SequenceParallel.shard`);
- `backend` and `mask`: the entry of the attention dispatch table (`backends.ATTENTION`) and what it reads: the
  dense bool [B, 1, L, Lk] mask (sdpa), the BlockMask (flex), a `SegmentPlan` (segmented), a `VarlenPlan` (varlen);
- `reuse`: prefix reuse's plan of a batch with a line over the pass budget (`reuse_plan.PrefixReuse`; its passes
  are plans of their own, derived from this one), and `prefix_kv`, the cached prefix store a pass records into or
  reads (`prefix_kv.PrefixKV`);
- `sequence_parallel`: the group whose ranks hold this pass's columns between them (`core.sequence_parallel`);
- `shared_prompt`: the cache of a decoding step over prompts held once (`shared_prompt`, GRPO's generation).

Deriving a plan (for a shard, for a chunk's cached prefix) returns a new one (`dataclasses.replace`); nothing is
written onto a plan, a mask or a tensor. The model itself still gets a real `attention_mask` (`model_mask`), which
transformers' mask code passes through untouched: the dense mask (sdpa) or the BlockMask (flex), as a stock model's
own sdpa or flex attention would run it, and for the backends whose mask is a plan (segmented, varlen) a zero-size
bool [B, 1, 0, 0]. A pass that reaches the attention without its plan (a model that drops the keyword) is refused in
one line where it would need the plan (`backends.prefix_attention_forward`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from prefixdpo.core.attention import varlen
from prefixdpo.core.attention.masks import block_mask, dense_mask
from prefixdpo.core.attention.reuse_plan import PrefixReuse, plan_reuse
from prefixdpo.core.attention.segments import build_segment_plan

# What a plan's `backend` names beyond the line backends: a decoding step over prompts held once ...
SHARED_PROMPT = "shared_prompt"
# ... and a pass on the model's own attention with a [B, L] padding mask (`core.stock_attention`: TRL's passes).
STOCK = "stock"
# The backends whose `mask` is one a stock attention runs (a dense bool mask, a BlockMask, a padding mask): the model
# gets it too.
MASK_BACKENDS = ("sdpa", "flex", STOCK)


@dataclasses.dataclass(frozen=True, eq=False)
class PassPlan:
    """What one forward pass runs (module docstring). eq=False: plans compare by identity (they hold tensors)."""

    spans: torch.Tensor
    backend: str
    mask: Any = None
    queries_from: int = 0
    key_spans: torch.Tensor | None = None  # [B, Lk, 2]: the keys' spans (from column 0), where queries_from > 0
    reuse: PrefixReuse | None = None
    prefix_kv: Any = None  # prefix_kv.PrefixKV
    sequence_parallel: Any = None  # sequence_parallel.SequenceParallel
    shared_prompt: Any = None  # transformers DynamicCache whose layers are `shared_prompt.SharedPromptLayer`s

    @property
    def batch_size(self) -> int:
        return int(self.spans.shape[0])

    def model_mask(self, tensor_only: bool = False):
        """The `attention_mask` the model gets (module docstring): the dense bool [B, 1, L, Lk] mask or the BlockMask
        where the backend's mask is one, else a zero-size bool [B, 1, 0, 0]. tensor_only: the stand-in for a BlockMask
        too, for a model whose own mask code reads the mask as a tensor (a hybrid's recurrent-layer mask reads its
        `.ndim`: 'BlockMask' object has no attribute 'ndim'); prefixdpo's attention reads the plan's mask anyway."""
        if self.backend in MASK_BACKENDS and not (tensor_only and self.backend == "flex"):
            return self.mask
        return torch.zeros(self.batch_size, 1, 0, 0, dtype=torch.bool, device=self.spans.device)

    def for_shard(self, sp) -> "PassPlan":
        """This plan run over `sp`'s ranks, each holding its columns (None: unchanged)."""
        return self if sp is None else dataclasses.replace(self, sequence_parallel=sp)

    def with_prefix_kv(self, store) -> "PassPlan":
        """This plan, its attention calls recording into or reading `store` (`PrefixKV`)."""
        return dataclasses.replace(self, prefix_kv=store)


def _line_mask(spans: torch.Tensor, backend: str, segment_waste: float, queries_from: int):
    """The `mask` of a plan over key spans [B, Lk, 2] (queries: the columns from `queries_from` on) for `backend`."""
    if backend == "varlen":
        return varlen.build_varlen_plan(spans, queries_from)
    if backend == "segmented":
        return build_segment_plan(spans, waste=segment_waste, queries_from=queries_from)
    if backend == "flex":
        return block_mask(spans, queries_from=queries_from)
    if backend == "sdpa":
        return dense_mask(spans, queries_from)
    raise ValueError(f"backend {backend!r} is not resolved; call resolve_backend first")


def plan_pass(lines, backend: str, *, segment_waste: float = 0.25, queries_from: int = 0,
              max_tokens_per_pass: int | None = None) -> PassPlan:
    """The plan of a pass over `lines` (a `data.lines.Lines`, or its [B, Lk, 2] spans) for a resolved backend.

    segment_waste: the padding a group of segments may add (`segments._group`). queries_from: the pass's queries
    are the columns from there on, its keys the whole line (the first columns are a cached prefix's,
    `core.prefix_reuse`). max_tokens_per_pass: with prefix reuse on, the budget of one pass: a batch with a line over
    it (or any batch of a run of several ranks) gets a plan whose `reuse` says how its passes run."""
    spans = lines if isinstance(lines, torch.Tensor) else lines.spans
    if max_tokens_per_pass is not None:
        reuse = plan_reuse(spans, max_tokens_per_pass, backend, segment_waste)
        if reuse is not None:
            return PassPlan(spans=spans, backend=backend, reuse=reuse)
    mask = _line_mask(spans, backend, segment_waste, queries_from)
    return PassPlan(spans=spans[:, queries_from:], backend=backend, mask=mask, queries_from=queries_from,
                    key_spans=spans if queries_from else None)


# every layer of a pass asks for the same derived masks: (the last plan, {(window, additive dtype): mask})
_derived_masks: tuple[PassPlan, dict] | None = None


def plan_mask(plan: PassPlan, window: int | None = None, additive: torch.dtype | None = None):
    """The mask one attention call of `plan` runs: the plan's own, or under a sliding layer's `window` (sdpa: the dense
    rule, flex: a BlockMask of it, `masks`), and with `additive` (sdpa) as an additive float mask of that dtype (0
    where allowed, the dtype's min elsewhere: what a model's own eager attention adds to its scores, `sinks`). A
    derived one is built once for the last plan (every layer of the pass, and gradient checkpointing's recompute, asks
    for the same); nothing is written onto the plan."""
    global _derived_masks
    if window is None and additive is None:
        return plan.mask
    if _derived_masks is None or _derived_masks[0] is not plan:
        _derived_masks = (plan, {})
    masks = _derived_masks[1]
    if (window, additive) not in masks:
        mask = plan.mask if window is None else _windowed(plan, window)
        if additive is not None:
            mask = torch.zeros(mask.shape, dtype=additive, device=mask.device).masked_fill_(
                ~mask, torch.finfo(additive).min)
        masks[window, additive] = mask
    return masks[window, additive]


def _windowed(plan: PassPlan, window: int):
    """`plan`'s mask under a sliding `window`, from its keys' spans (sdpa and flex; `masks`)."""
    keys = plan.spans if plan.key_spans is None else plan.key_spans
    if plan.backend == "flex":
        return block_mask(keys, block_size=plan.mask.BLOCK_SIZE[0], queries_from=plan.queries_from, window=window)
    if plan.backend == "sdpa":
        return dense_mask(keys, plan.queries_from, window)
    raise ValueError(f"the {plan.backend} backend does not slide a window over a shared line")


def reuse_pass_plan(spans: torch.Tensor, reuse: PrefixReuse) -> PassPlan:
    """The plan of a batch run as `reuse` says (a `PrefixReuse` built elsewhere: tests, benches)."""
    return PassPlan(spans=spans, backend=reuse.backend, reuse=reuse)


def decoding_plan(cache, rows: int, device) -> PassPlan:
    """The plan of each decoding step of `rows` rows over `cache`, whose layers hold the prompts once
    (`shared_prompt`). A decoding step is no line pass: its spans are empty ([rows, 0, 2]) and the mask is
    transformers' own, from the decoding rows' padding."""
    empty = torch.zeros(rows, 0, 2, dtype=torch.long, device=device)
    return PassPlan(spans=empty, backend=SHARED_PROMPT, shared_prompt=cache)


__all__ = ["PassPlan", "SHARED_PROMPT", "STOCK", "decoding_plan", "plan_pass", "plan_mask", "reuse_pass_plan"]
