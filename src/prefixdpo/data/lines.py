"""`Lines`: the one line layout every pass runs, and the one collate that builds it.

A line is one row of the `[B, L]` batch the model runs. Whatever put tokens there (a prompt with its responses, the
standard `[prompt][response]` rows, several examples packed, a token trie across records, a GRPO prompt with its
sampled completions), a line holds a forest of token tries laid out depth first, and its structure is explicit:
each slot's `span` = (tin, tout), its own column and the end of its subtree::

    q may attend kv  <=>  tin[kv] <= tin[q] < tout[kv]          (kv is q or one of q's ancestors)

A prefix-shared example is a depth-1 trie (the prompt, then each response as a branch), a standard row a single
chain, packing puts several roots in one line, and `data.tree` builds deeper tries; every attention backend has one
rule, over the spans (`core.attention.backends.attention_mask`). Position ids are each token's position in its own
sequence, so every response's log-probs equal its plain `[prompt][response]` pass.

The scored tokens are grouped in *responses* (leaves' sequences): a DPO/reward response, or one TRL row's
completion. Each has a line and the column of its sequence's last token (`response_last`); its sequence is exactly
the tokens whose span holds that column, which is what reward scores and MoE token weights read.

The pieces a layout hands the collate are `Row`s (`data.layout`): one trie each, with row-relative spans and targets.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import numpy as np
import torch

from prefixdpo.data.packing import round_up

PAD = -1  # the span of a padding slot: (-1, -1)


@dataclass(frozen=True)
class Row:
    """One token trie laid out depth first: the piece a layout hands `collate`. All tuples have the row's length n
    unless noted; indices are row positions.

    input_ids, position_ids: [n]
    tout:            [n] the end of each token's subtree (its tin is its own position)
    target_index:    [t] the position whose hidden state predicts each scored token
    target_ids:      [t] the scored tokens
    target_response: [t] the number (the layout's own, e.g. the example's response index) of each target's response
    responses:       [k] the numbers of the row's responses, in row order
    response_last:   [k] the position of the last token of each response's sequence (the prompt's last token for a
                     response with no token)
    """

    input_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    tout: tuple[int, ...]
    target_index: tuple[int, ...]
    target_ids: tuple[int, ...]
    target_response: tuple[int, ...]
    responses: tuple[int, ...]
    response_last: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)


# a piece of a line: a Row and the batch-wide number of each of its responses, indexed by the Row's own numbers
Piece = tuple[Row, Sequence[int]]


@dataclass
class Lines:
    """B lines of L slots (T scored tokens, R responses), as the model's forward and the log-prob gather need them.

    input_ids, position_ids: [B, L] long (padding: the pad id, position 0)
    spans:           [B, L, 2] long, (tin, tout) of each slot (module docstring); (-1, -1) for padding
    target_line, target_col: [T] long, the slot whose hidden state predicts each scored token
    target_ids:      [T] long, the scored tokens
    target_response: [T] long, the response 0..R-1 of each scored token (a response's tokens in order)
    response_line, response_last: [R] long, each response's line and the column of its sequence's last token
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    spans: torch.Tensor
    target_line: torch.Tensor
    target_col: torch.Tensor
    target_ids: torch.Tensor
    target_response: torch.Tensor
    response_line: torch.Tensor
    response_last: torch.Tensor

    @property
    def num_lines(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_real_tokens(self) -> int:
        return int((self.spans[..., 0] >= 0).sum())

    @property
    def num_responses(self) -> int:
        return int(self.response_line.numel())

    def to(self, device: torch.device | str):
        return self._with_tensors(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self):
        """A copy in page-locked memory (`DataLoader(pin_memory=True)` calls this): `to(cuda)` is then asynchronous."""
        return self._with_tensors(lambda t: t.pin_memory())

    def _with_tensors(self, fn):
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def bucket_length(n: int, base: int = 128) -> int:
    """Round `n` up to the next of a few lengths: base x {1, 2, 3, 4, 6, 8, 12, 16, ...} (steps of 1.5-2x).

    Compiled FlexAttention (CUDA) compiles once per line length: bucketing keeps that to a handful.
    """
    blocks = -(-int(n) // base)
    size = 1
    while size < blocks:  # 1, 2, 3, 4, 6, 8, 12, 16, ... : powers of two and 1.5 x powers of two
        size = size * 3 // 2 if size >= 2 and size & (size - 1) == 0 else (size * 4 // 3 if size >= 3 else size + 1)
    return size * base


def line_length(longest: int, *, length: int | None = None, pad_multiple: int = 1, bucket: bool = False) -> int:
    """The length L of lines whose longest holds `longest` tokens: `length` if given (refused if too short), else
    `longest` rounded up to `pad_multiple`, or to `bucket_length` when `bucket`."""
    longest = max(longest, 1)
    L = length if length is not None else bucket_length(longest) if bucket else round_up(longest, pad_multiple)
    if longest > L:
        raise ValueError(f"a line holds {longest} tokens, more than the line length {L}")
    return L


def _as_long(values) -> torch.Tensor:
    # through numpy: torch.tensor reads a long Python list about 4x slower
    return torch.from_numpy(np.asarray(values, dtype=np.int64).reshape(-1))


def collate(lines: Sequence[Sequence[Piece]], num_responses: int, *, pad_token_id: int = 0,
            length: int | None = None, pad_multiple: int = 1, bucket: bool = False) -> dict[str, torch.Tensor]:
    """The fields of `Lines` (a dict of tensors, on the CPU) for `lines` of pieces, each line its pieces side by
    side; every one of the `num_responses` responses must be in exactly one piece (length, pad_multiple, bucket: see
    `line_length`)."""
    L = line_length(max((sum(len(row) for row, _ in line) for line in lines), default=1), length=length,
                    pad_multiple=pad_multiple, bucket=bucket)
    B = len(lines)
    input_ids = np.full((B, L), pad_token_id, dtype=np.int64)
    position_ids = np.zeros((B, L), dtype=np.int64)
    spans = np.full((B, L, 2), PAD, dtype=np.int64)
    t_line, t_col, t_ids, t_resp = [], [], [], []
    r_line, r_last = [-1] * num_responses, [-1] * num_responses
    for b, line in enumerate(lines):
        start = 0
        for row, numbers in line:
            end = start + len(row)
            input_ids[b, start:end] = row.input_ids
            position_ids[b, start:end] = row.position_ids
            spans[b, start:end, 0] = np.arange(start, end)
            spans[b, start:end, 1] = np.asarray(row.tout, dtype=np.int64) + start
            for k, last in zip(row.responses, row.response_last):  # last -1: a sequence without a token
                r_line[numbers[k]], r_last[numbers[k]] = b, start + last if last >= 0 else -1
            t_line.append(np.full(len(row.target_ids), b, dtype=np.int64))
            t_col.append(np.asarray(row.target_index, dtype=np.int64) + start)
            t_ids.append(row.target_ids)
            t_resp.append(np.asarray(numbers, dtype=np.int64)[np.asarray(row.target_response, dtype=np.int64)])
            start = end
    if -1 in r_line:
        raise ValueError(f"response {r_line.index(-1)} of the batch is in none of its lines")

    def cat(parts) -> torch.Tensor:
        return _as_long(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else [])

    return dict(input_ids=torch.from_numpy(input_ids), position_ids=torch.from_numpy(position_ids),
                spans=torch.from_numpy(spans), target_line=cat(t_line), target_col=cat(t_col), target_ids=cat(t_ids),
                target_response=cat(t_resp), response_line=_as_long(r_line), response_last=_as_long(r_last))


def padded(lines: Lines, multiple: int, pad_token_id: int = 0):
    """`lines` (any `Lines`, e.g. a `Batch`) with padding columns appended up to a multiple of `multiple` (the same
    object when already there): pad ids, position 0, spans (-1, -1); targets and responses keep their columns."""
    B, L = lines.input_ids.shape
    extra = round_up(L, multiple) - L
    if extra == 0:
        return lines

    def grow(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((B, extra, *t.shape[2:]), value)], dim=1)

    return replace(lines, input_ids=grow(lines.input_ids, pad_token_id), position_ids=grow(lines.position_ids, 0),
                   spans=grow(lines.spans, PAD))


def sequence_counts(lines: Lines, per_response: torch.Tensor) -> torch.Tensor:
    """For each slot, the sum of `per_response` [R] over the responses whose sequence holds it (the responses whose
    last column its span [tin, tout) holds: it and its descendants). -> [B, L] in per_response's dtype, 0 for padding.

    A node is computed once but lies on every sequence through it: this is how many times rows that hold each
    sequence separately (TRL's, weighted by `per_response`) hold the node's token. Each response's count sits at its
    last column; a node sums the counts in its span, by a prefix sum along the line.
    """
    B, L = lines.input_ids.shape
    counts = torch.zeros(B, L + 1, dtype=per_response.dtype, device=per_response.device)
    counts.index_put_((lines.response_line, lines.response_last + 1), per_response, accumulate=True)
    before = counts.cumsum(dim=1)  # [B, L + 1]: before[b, c] = the counts at columns < c
    tin, tout = lines.spans[..., 0], lines.spans[..., 1]
    weight = before.gather(1, tout.clamp(min=0)) - before.gather(1, tin.clamp(min=0))
    return torch.where(tin >= 0, weight, torch.zeros((), dtype=weight.dtype, device=weight.device))


def sequence_tokens(lines: Lines) -> torch.Tensor:
    """[R, L] bool: the slots of each response's sequence in its line (its last column's ancestors and itself)."""
    spans, last = lines.spans[lines.response_line], lines.response_last[:, None]  # [R, L, 2], [R, 1]
    return (spans[..., 0] <= last) & (last < spans[..., 1])  # padding's span (-1, -1) holds no column


__all__ = ["Lines", "PAD", "Piece", "Row", "bucket_length", "collate", "line_length", "padded", "sequence_counts",
           "sequence_tokens"]
