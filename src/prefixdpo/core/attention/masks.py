"""The prefix-sharing attention rule, as a FlexAttention `mask_mod` and as a dense boolean mask.

    q may attend kv  <=>  doc[q] == doc[kv] >= 0          (same document; padding has doc -1)
                      and kv <= q                          (causal in line order)
                      and branch[kv] in (0, branch[q])     (the shared prompt, or its own response)
                      or  q == kv                          (padding attends only itself)

The last clause exists only so padded queries never see an all-masked row: SDPA turns those into NaN,
and NaN leaks into gradients even where the loss ignores the position. Real queries always attend
themselves anyway, so the clause changes nothing for them.

Tree lines (`data.tree`) generalise the rule from depth 1 to any depth: with each token's node span
[tin, tout) in depth-first order, q may attend kv <=> tin[kv] <= tin[q] < tout[kv] (kv is q or an ancestor of
q), or q == kv (padding, span (-1, -1)). `tree_dense_mask` is that rule for SDPA, `tree_mask_mod` for flex.
"""

from __future__ import annotations

from typing import Callable

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def prefix_sharing_mask_mod(doc_ids: torch.Tensor, branch_ids: torch.Tensor) -> MaskMod:
    """mask_mod(b, h, q, kv) -> bool for FlexAttention; doc_ids, branch_ids: [B, L]."""

    def mask_mod(b, h, q_idx, kv_idx):
        doc_q = doc_ids[b, q_idx]
        same_doc = (doc_q == doc_ids[b, kv_idx]) & (doc_q >= 0)
        causal = kv_idx <= q_idx
        branch_kv = branch_ids[b, kv_idx]
        branch_ok = (branch_kv == 0) | (branch_kv == branch_ids[b, q_idx])
        return (same_doc & causal & branch_ok) | (q_idx == kv_idx)

    return mask_mod


def dense_mask(doc_ids: torch.Tensor, branch_ids: torch.Tensor) -> torch.Tensor:
    """The rule as a boolean mask [B, 1, L, L] (True = may attend), for SDPA.

    doc_ids, branch_ids: [B, L].
    """
    L = doc_ids.shape[1]
    idx = torch.arange(L, device=doc_ids.device)
    doc_q, doc_kv = doc_ids[:, :, None], doc_ids[:, None, :]
    br_q, br_kv = branch_ids[:, :, None], branch_ids[:, None, :]
    causal = idx[None, :, None] >= idx[None, None, :]
    allowed = (doc_q == doc_kv) & (doc_q >= 0) & causal & ((br_kv == 0) | (br_kv == br_q))
    allowed |= torch.eye(L, dtype=torch.bool, device=doc_ids.device)[None]
    return allowed[:, None]


def block_mask(doc_ids: torch.Tensor, branch_ids: torch.Tensor, *, block_size: int = 128):
    """The rule as a FlexAttention BlockMask over [B, L] lines (L should be a multiple of block_size)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, L = doc_ids.shape
    return create_block_mask(
        prefix_sharing_mask_mod(doc_ids, branch_ids), B, None, L, L,
        device=doc_ids.device, BLOCK_SIZE=block_size,
    )


def tree_dense_mask(tree_spans: torch.Tensor) -> torch.Tensor:
    """The tree rule as a boolean mask [B, 1, L, L] (True = may attend), for SDPA.

    tree_spans: [B, L, 2] long, (tin, tout) of each token's node; (-1, -1) for padding.
    """
    tin, tout = tree_spans[..., 0], tree_spans[..., 1]
    L = tin.shape[1]
    ancestor = (tin[:, None, :] <= tin[:, :, None]) & (tin[:, :, None] < tout[:, None, :])  # [B, q, kv]
    ancestor &= tin[:, None, :] >= 0
    ancestor |= torch.eye(L, dtype=torch.bool, device=tin.device)[None]
    return ancestor[:, None]


def tree_mask_mod(tree_spans: torch.Tensor) -> MaskMod:
    """The tree rule as a FlexAttention mask_mod(b, h, q, kv) -> bool; tree_spans: [B, L, 2] (tin, tout)."""
    # contiguous [B, L] buffers: inductor's CPU flex kernel refuses strided views inside a mask_mod
    tin, tout = tree_spans[..., 0].contiguous(), tree_spans[..., 1].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        tin_kv = tin[b, kv_idx]
        ancestor = (tin_kv <= tin[b, q_idx]) & (tin[b, q_idx] < tout[b, kv_idx]) & (tin_kv >= 0)
        return ancestor | (q_idx == kv_idx)

    return mask_mod


def tree_block_mask(tree_spans: torch.Tensor, *, block_size: int = 128):
    """The tree rule as a FlexAttention BlockMask over [B, L] tree lines (L should be a multiple of block_size)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, L, _ = tree_spans.shape
    return create_block_mask(tree_mask_mod(tree_spans), B, None, L, L, device=tree_spans.device, BLOCK_SIZE=block_size)
