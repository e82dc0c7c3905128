"""The attention rule of prefixdpo's lines, as a dense boolean mask (SDPA) and as a FlexAttention `mask_mod`.

Every line is a forest of token tries laid out depth first (`data.lines`): with each slot's node span [tin, tout),

    q may attend kv  <=>  tin[kv] <= tin[q] < tout[kv]      (kv is q or one of q's ancestors)
                      or  q == kv                          (padding, span (-1, -1), attends only itself)

A prefix-shared row is its depth-1 case (the prompt's tokens are every response's ancestors; a response's own
tokens are a chain), packing puts several roots in a line, a standard row is one chain. The last clause exists only
so padded queries never see an all-masked row: SDPA turns those into NaN, and NaN leaks into gradients even where
the loss ignores the position. Real queries always attend themselves anyway, so the clause changes nothing for them.
"""

from __future__ import annotations

from typing import Callable

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dense_mask(spans: torch.Tensor, queries_from: int = 0, window: int | None = None) -> torch.Tensor:
    """The rule as a boolean mask [B, 1, L - queries_from, L] (True = may attend), for SDPA.

    spans: [B, L, 2] long, (tin, tout) of each slot's node; (-1, -1) for padding. queries_from: the queries are the
    columns from there on (the first ones are a cached prefix: keys only, `core.prefix_reuse`). window: a sliding
    layer's, keeping the keys fewer than `window` positions back along the query's sequence (`depths`; transformers'
    `kv_idx > q_idx - sliding_window`).
    """
    tin, tout = spans[..., 0], spans[..., 1]
    L = tin.shape[1]
    q_tin = tin[:, queries_from:]
    ancestor = (tin[:, None, :] <= q_tin[:, :, None]) & (q_tin[:, :, None] < tout[:, None, :])  # [B, q, kv]
    ancestor &= tin[:, None, :] >= 0
    if window is not None:
        depth = depths(spans)
        ancestor &= depth[:, queries_from:, None] - depth[:, None, :] < window
    ancestor |= torch.eye(L, dtype=torch.bool, device=tin.device)[queries_from:][None]
    return ancestor[:, None]


def depths(spans: torch.Tensor) -> torch.Tensor:
    """Each column's depth [B, L] long: how many ancestors it has, i.e. its position in its own sequence (0 for a
    root and for padding). spans [B, L, 2] in the depth-first layout (`data.lines`: tin is the column), so the
    ancestors of column j are the columns k <= j whose subtree [k, tout[k]) holds j: +1 at each real k, -1 at its
    tout, summed along the line, counts them (j itself included)."""
    B, L, _ = spans.shape
    tin, tout = spans[..., 0], spans[..., 1]
    real = tin >= 0
    steps = torch.zeros(B, L + 1, dtype=torch.long, device=spans.device)
    steps.scatter_add_(1, torch.where(real, tin, L), real.long())
    steps.scatter_add_(1, torch.where(real, tout, L), -real.long())
    return (steps[:, :L].cumsum(1) - 1).clamp_min(0)


def mask_mod(spans: torch.Tensor, queries_from: int = 0, window: int | None = None) -> MaskMod:
    """The rule as a FlexAttention mask_mod(b, h, q, kv) -> bool; spans: [B, L, 2] (tin, tout); query q is column
    q + queries_from (see `dense_mask`). window: a sliding layer's, keeping the keys fewer than `window` positions
    back along the query's sequence (`depths`, as `dense_mask`)."""
    # contiguous [B, L] buffers: inductor's CPU flex kernel refuses strided views inside a mask_mod
    tin, tout = spans[..., 0].contiguous(), spans[..., 1].contiguous()
    depth = depths(spans).contiguous() if window is not None else None

    def ancestor_or_self(b, h, q_idx, kv_idx):
        q = q_idx + queries_from
        tin_kv = tin[b, kv_idx]
        ancestor = (tin_kv <= tin[b, q]) & (tin[b, q] < tout[b, kv_idx]) & (tin_kv >= 0)
        return ancestor | (q == kv_idx)

    if depth is None:
        return ancestor_or_self

    def within_window(b, h, q_idx, kv_idx):
        return ancestor_or_self(b, h, q_idx, kv_idx) & (depth[b, q_idx + queries_from] - depth[b, kv_idx] < window)

    return within_window


def block_mask(spans: torch.Tensor, *, block_size: int = 128, queries_from: int = 0, window: int | None = None):
    """The rule as a FlexAttention BlockMask over [B, L] lines (L should be a multiple of block_size), its queries
    the columns from `queries_from` on (see `dense_mask`), under a sliding `window` if given (`mask_mod`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, L, _ = spans.shape
    return create_block_mask(mask_mod(spans, queries_from, window), B, None, L - queries_from, L,
                             device=spans.device, BLOCK_SIZE=block_size)

