"""Segmented attention: compute only the query-key blocks the attention rule allows.

A dense `[L, L]` mask makes SDPA compute every query-key pair of a line, allowed or not. Here each line (a forest of
token tries laid out depth first, `data.lines`) is cut into *segments* whose allowed keys are contiguous in a small
gathered sequence: each maximal run of tokens each the child of the one before it is one segment, its queries the
run, its keys the run's ancestors then the run, causal aligned bottom-right (query i sees every ancestor and run
tokens 0..i). A tree's first root-to-leaf path is therefore one plain causal segment; for a prefix-shared example
(depth 1) that is the prompt and its first response, and every later response k is a segment of its own queries over
the keys `[prompt][response k]`.

Segments of similar size are gathered into padded groups and run through SDPA, and the outputs are
scattered back to their line positions. The math per query is the same softmax over the same keys in
the same order as the dense rule, so results agree to float rounding.

The plan (index tensors) is built once per batch and reused by every layer, for the policy and the
reference pass alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SegmentGroup:
    """S segments padded to Lq queries and Lk keys (segment s: query_counts[s] queries over key_counts[s] keys).

    mask(window): [S, 1, Lq, Lk] bool, True = may attend (padded queries attend key 0 so no softmax row is empty),
    under a sliding layer's `window` if given, built on `device` when asked. additive_mask(dtype, window): the same as
    SDPA's additive float mask (0 / -inf), built once per dtype and window and kept: SDPA would otherwise convert the
    bool mask in every call (each layer, forward and backward).

    causal: every segment has as many queries as keys (prompt + first response), so each real query's keys are
    exactly a top-left causal pattern and SDPA runs with `is_causal=True` instead of the mask: measured on CPU
    (torch 2.13, 1 thread), its kernel takes about twice as long with a boolean mask as causally without one.
    Padded queries then see other keys than the mask says, but their outputs are never read (zero gradient).
    Such a group's mask is never built in a pass."""

    num_segments: int
    num_queries: int
    num_keys: int
    query_counts: list[int]
    key_counts: list[int]
    causal: bool = False
    device: torch.device | str = "cpu"
    _masks: dict = field(default_factory=dict, repr=False, compare=False)

    def mask(self, window: int | None = None) -> torch.Tensor:
        return _group_mask(self.query_counts, self.key_counts, self.num_queries, self.num_keys,
                           window).to(self.device)

    def additive_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        if (dtype, window) not in self._masks:  # kept without its bool source: at most 1 + itemsize bytes a cell
            allowed = self.mask(window)
            self._masks[dtype, window] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf"))
        return self._masks[dtype, window]

    def runs_causal(self, window: int | None = None) -> bool:
        """Whether SDPA runs this group with `is_causal` and no mask: square segments no window cuts into."""
        return self.causal and (window is None or self.num_keys <= window)


def _group_mask(query_counts: list[int], key_counts: list[int], Lq: int, Lk: int,
                window: int | None = None) -> torch.Tensor:
    """[S, 1, Lq, Lk] bool: segment s's nq queries see keys bottom-right causally (query i: keys 0 .. nk - nq + i),
    its padded queries key 0 only; padded keys nothing. A segment's keys are its sequence's tokens in order (the run's
    ancestors from the root, then the run), so key j is at position j and query i at nk - nq + i: a sliding `window`
    keeps the keys fewer than `window` positions back (transformers' `kv_idx > q_idx - sliding_window`)."""
    mask = torch.zeros(len(query_counts), 1, Lq, Lk, dtype=torch.bool)
    for s, (nq, nk) in enumerate(zip(query_counts, key_counts)):
        qi = torch.arange(nq)[:, None] + (nk - nq)
        kj = torch.arange(nk)[None, :]
        allowed = kj <= qi
        if window is not None:
            allowed &= kj > qi - window
        mask[s, 0, :nq, :nk] = allowed
        mask[s, 0, nq:, 0] = True
    return mask


@dataclass
class SegmentPlan:
    """All segment groups of a batch of [B, L] queries (over [B, Lk] keys: Lk = L, or more when the keys hold a cached
    prefix), with flat gather indices shared by every layer.

    q_index:  [Q] flat query index (b * L + t) of every padded query slot, groups concatenated
    kv_index: [K] flat key index (b * Lk + t) of every padded key slot, groups concatenated
    out_index:[B * L] row of the concatenated output holding each query's result; padding tokens
              point at an extra all-zero row (index Q) so they get zeros
    """

    batch_size: int
    length: int
    groups: list[SegmentGroup]
    q_index: torch.Tensor
    kv_index: torch.Tensor
    out_index: torch.Tensor


def line_segments(spans: torch.Tensor, queries_from: int = 0) -> list[tuple[list[int], list[int]]]:
    """(query flat indices, key flat indices) per segment of [B, L, 2] spans ((-1, -1) = padding), in line order:
    each maximal run of tokens whose parent is the token before it, keyed by its ancestors and itself.

    In a depth-first line a real token's column is its tin, and t - 1 is t's parent exactly when t lies in t - 1's
    subtree (t < tout[t - 1]); the ancestors of a run starting at s are the tokens u < s whose subtree holds s.

    queries_from: only the columns from there on are queries (a pass over external keys: the line's first
    `queries_from` tokens are a cached prefix, `core.prefix_reuse`); query indices are then flat over the
    [B, L - queries_from] queries, key indices over the whole [B, L] line.
    """
    B, L, _ = spans.shape
    Lq = L - queries_from
    tin, tout = spans[..., 0].cpu().numpy(), spans[..., 1].cpu().numpy()
    columns = np.arange(L)
    out: list[tuple[list[int], list[int]]] = []
    for b in range(B):
        real = tin[b] >= 0
        continues = np.zeros(L, dtype=bool)
        continues[1:] = real[:-1] & (tout[b, :-1] > columns[1:])
        starts = np.flatnonzero(real & ~continues)
        for s, end in zip(starts, [*starts[1:], L]):
            run = columns[s:end][real[s:end]]
            ancestors = np.flatnonzero(real[:s] & (tout[b, :s] > s))
            keys = (np.concatenate([ancestors, run]) + b * L).tolist()
            queries = run[run >= queries_from]
            if len(queries):
                out.append(((queries - queries_from + b * Lq).tolist(), keys))
    return out


def _group(segs: list[tuple[list[int], list[int]]], waste: float, min_cells: int) -> list[list[int]]:
    """Indices of segments grouped so padding adds at most ~`waste` of the real work plus `min_cells`
    query-key cells: each group is one SDPA call (forward and backward, every layer), and a call's fixed
    cost is worth about a 128 x 128 block of attention on CPU, so small segments are better padded
    together than run alone.

    Prompt-and-first-response segments (as many queries as keys) and later-response segments (few
    queries, many keys) never share a group: padding one shape to the other would cost more than the
    attention it replaces.
    """
    groups: list[list[int]] = []
    for square in (True, False):
        kind = [i for i, (q, k) in enumerate(segs) if (len(q) == len(k)) == square]
        order = sorted(kind, key=lambda i: (len(segs[i][1]), len(segs[i][0])), reverse=True)
        current: list[int] = []
        real = lq = lk = 0
        for i in order:
            q, k = len(segs[i][0]), len(segs[i][1])
            new_lq, new_lk, new_real = max(lq, q), max(lk, k), real + q * k
            if current and (len(current) + 1) * new_lq * new_lk > (1 + waste) * new_real + min_cells:
                groups.append(current)
                current, new_lq, new_lk, new_real = [], q, k, q * k
            current.append(i)
            lq, lk, real = new_lq, new_lk, new_real
        if current:
            groups.append(current)
    return groups


def build_segment_plan(spans: torch.Tensor, *, waste: float = 0.25, min_cells: int = 128 * 128,
                       queries_from: int = 0) -> SegmentPlan:
    """Plan segmented attention for lines' [B, L, 2] spans (see module docstring); `waste`, `min_cells`: how much
    padding a group of segments may add (`_group`); queries_from: see `line_segments`."""
    B, L, _ = spans.shape
    segs = line_segments(spans.cpu(), queries_from)
    groups = []
    q_index: list[int] = []
    kv_index: list[int] = []
    out_index = [-1] * (B * (L - queries_from))
    for members in _group(segs, waste, min_cells):
        Lq = max(len(segs[i][0]) for i in members)
        Lk = max(len(segs[i][1]) for i in members)
        for i in members:
            q, k = segs[i]
            for j, token in enumerate(q):
                out_index[token] = len(q_index) + j
            q_index.extend(q + [q[0]] * (Lq - len(q)))
            kv_index.extend(k + [k[0]] * (Lk - len(k)))
        square = all(len(segs[i][0]) == len(segs[i][1]) for i in members)
        groups.append(SegmentGroup(len(members), Lq, Lk, [len(segs[i][0]) for i in members],
                                   [len(segs[i][1]) for i in members], causal=square, device=spans.device))
    zero_row = len(q_index)
    out_index = [zero_row if i < 0 else i for i in out_index]

    def as_tensor(x: list[int]) -> torch.Tensor:
        # through numpy: torch.tensor reads a long Python list about 4x slower (2.7 ms vs 0.7 ms for 15k ints)
        return torch.from_numpy(np.fromiter(x, dtype=np.int64, count=len(x))).to(spans.device)

    return SegmentPlan(B, L - queries_from, groups, as_tensor(q_index), as_tensor(kv_index), as_tensor(out_index))


def segmented_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: SegmentPlan,
    *, scaling: float | None = None, dropout: float = 0.0, window: int | None = None, attend=None,
) -> torch.Tensor:
    """query [B, H, L, D], key/value [B, Hkv, Lk, D] -> output [B, L, H, D] (transformers' layout); Lk > L when the
    keys hold a cached prefix before the queries' own (the plan's `queries_from`); window: a sliding layer's
    (`_group_mask`). attend: where SDPA cannot run the layer (attention sinks), the attention of one group instead,
    (q [S, H, Lq, D], k/v [S, Hkv, Lk, D], additive mask [S, 1, Lq, Lk]) -> [S, Lq, H, Dv]: every query's keys are
    in its segment, so a term each query's softmax holds once (a sink) is held once here too.

    One gather for all queries, one for all keys/values, one for the output: per-group gathers would
    each allocate a full-size gradient buffer in backward. `index_select` rather than `t[idx]`: its
    backward is `index_add`, far faster on CPU than the accumulating `index_put` of advanced indexing.
    Positions outside every segment (padding) get zeros.
    """
    B, H, L, D = query.shape
    Hkv, Lk, Dv = key.shape[1], key.shape[2], value.shape[-1]
    q_all = query.transpose(1, 2).reshape(B * L, H, D).index_select(0, plan.q_index)  # [Q, H, D]
    k_all = key.transpose(1, 2).reshape(B * Lk, Hkv, D).index_select(0, plan.kv_index)  # [K, Hkv, D]
    v_all = value.transpose(1, 2).reshape(B * Lk, Hkv, Dv).index_select(0, plan.kv_index)
    outs = []
    # torch.split, not slicing: a slice's backward fills a full-size zero buffer per group
    q_parts = q_all.split([g.num_segments * g.num_queries for g in plan.groups])
    k_parts = k_all.split([g.num_segments * g.num_keys for g in plan.groups])
    v_parts = v_all.split([g.num_segments * g.num_keys for g in plan.groups])
    for g, q, k, v in zip(plan.groups, q_parts, k_parts, v_parts):
        S, Lq, Lk = g.num_segments, g.num_queries, g.num_keys
        q = q.view(S, Lq, H, D).transpose(1, 2)
        k = k.view(S, Lk, Hkv, D).transpose(1, 2)
        v = v.view(S, Lk, Hkv, Dv).transpose(1, 2)
        if attend is not None:
            outs.append(attend(q, k, v, g.additive_mask(q.dtype, window)).reshape(S * Lq, H, Dv))
            continue
        causal = g.runs_causal(window)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None if causal else g.additive_mask(q.dtype, window), dropout_p=dropout,
            is_causal=causal, scale=scaling, enable_gqa=Hkv != H,
        )  # [S, H, Lq, Dv]
        outs.append(o.transpose(1, 2).reshape(S * Lq, H, Dv))
    outs.append(q_all.new_zeros(1, H, Dv))  # the row padding tokens read
    return torch.cat(outs).index_select(0, plan.out_index).view(B, L, H, Dv)
