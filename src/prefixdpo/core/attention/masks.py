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


def dense_mask(spans: torch.Tensor) -> torch.Tensor:
    """The rule as a boolean mask [B, 1, L, L] (True = may attend), for SDPA.

    spans: [B, L, 2] long, (tin, tout) of each slot's node; (-1, -1) for padding.
    """
    tin, tout = spans[..., 0], spans[..., 1]
    L = tin.shape[1]
    ancestor = (tin[:, None, :] <= tin[:, :, None]) & (tin[:, :, None] < tout[:, None, :])  # [B, q, kv]
    ancestor &= tin[:, None, :] >= 0
    ancestor |= torch.eye(L, dtype=torch.bool, device=tin.device)[None]
    return ancestor[:, None]


def mask_mod(spans: torch.Tensor) -> MaskMod:
    """The rule as a FlexAttention mask_mod(b, h, q, kv) -> bool; spans: [B, L, 2] (tin, tout)."""
    # contiguous [B, L] buffers: inductor's CPU flex kernel refuses strided views inside a mask_mod
    tin, tout = spans[..., 0].contiguous(), spans[..., 1].contiguous()

    def ancestor_or_self(b, h, q_idx, kv_idx):
        tin_kv = tin[b, kv_idx]
        ancestor = (tin_kv <= tin[b, q_idx]) & (tin[b, q_idx] < tout[b, kv_idx]) & (tin_kv >= 0)
        return ancestor | (q_idx == kv_idx)

    return ancestor_or_self


def block_mask(spans: torch.Tensor, *, block_size: int = 128):
    """The rule as a FlexAttention BlockMask over [B, L] lines (L should be a multiple of block_size)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, L, _ = spans.shape
    return create_block_mask(mask_mod(spans), B, None, L, L, device=spans.device, BLOCK_SIZE=block_size)
