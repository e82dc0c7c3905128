"""`Rows -> Batch`: the lines of a preference batch (`data.lines.Lines`) with its responses and pairs.

A *line* is one row of the `[B, L]` batch. Unpacked, each `Row` gets its own line; packed, several
examples' rows share a line, side by side (each its own trie). Responses are numbered example by example.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from prefixdpo.data.example import Example
from prefixdpo.data.layout import layout_example
from prefixdpo.data.lines import Lines, Piece, Row, bucket_length, collate

__all__ = ["Batch", "batch_of", "bucket_length", "build_batch", "collate_lines", "response_offsets"]


@dataclass
class Batch(Lines):
    """The lines of a preference batch (`Lines`: tokens, spans, scored tokens and their responses, R responses
    numbered example by example), and its P preference pairs.

    response_lengths: [R] long, tokens per response
    pair_better, pair_worse: [P] long, response numbers (better preferred to worse)
    max_sequence_length: the longest `[prompt][response]` sequence of the batch (sliding-window checks)
    """

    response_lengths: torch.Tensor
    pair_better: torch.Tensor
    pair_worse: torch.Tensor
    max_sequence_length: int = 0

    @property
    def num_pairs(self) -> int:
        return int(self.pair_better.numel())


def response_offsets(examples: Sequence[Example]) -> list[int]:
    """[N + 1]: the number of each example's first response (its responses follow), and R last."""
    offsets = [0]
    for ex in examples:
        offsets.append(offsets[-1] + ex.num_responses)
    return offsets


def batch_of(examples: Sequence[Example], lines: Sequence[Sequence[Piece]], **collate_options) -> Batch:
    """The Batch of `examples` laid out as `lines` of pieces (`lines.collate`; its options) whose responses are
    numbered example by example."""
    offsets = response_offsets(examples)
    better = [offsets[e] + i for e, ex in enumerate(examples) for i, _ in ex.pairs]
    worse = [offsets[e] + j for e, ex in enumerate(examples) for _, j in ex.pairs]
    return Batch(
        **collate(lines, offsets[-1], **collate_options),
        response_lengths=torch.tensor([len(r) for ex in examples for r in ex.response_ids], dtype=torch.long),
        pair_better=torch.tensor(better, dtype=torch.long),
        pair_worse=torch.tensor(worse, dtype=torch.long),
        max_sequence_length=max((len(ex.prompt_ids) + len(r) for ex in examples for r in ex.response_ids), default=0),
    )


def collate_lines(
    examples: Sequence[Example],
    lines: Sequence[Sequence[tuple[int, Row]]],
    *,
    pad_token_id: int = 0,
    length: int | None = None,
    pad_multiple: int = 1,
    bucket: bool = False,
) -> Batch:
    """Build a Batch from lines of (example index, Row of that example: its responses numbered as the example
    numbers them); every row of an example must be in this batch.

    length: fixed line length (e.g. the pack length); default the longest line rounded up to pad_multiple,
            or to `bucket_length` when `bucket`.
    """
    offsets = response_offsets(examples)
    pieces = [[(row, range(offsets[e], offsets[e + 1])) for e, row in line] for line in lines]
    return batch_of(examples, pieces, pad_token_id=pad_token_id, length=length, pad_multiple=pad_multiple,
                    bucket=bucket)


def build_batch(
    examples: Sequence[Example],
    *,
    prefix_sharing: bool = True,
    packs: Sequence[Sequence[int]] | None = None,
    pad_token_id: int = 0,
    length: int | None = None,
    pad_multiple: int = 1,
    bucket: bool = False,
) -> Batch:
    """Lay out and collate examples (length, pad_multiple, bucket: see `collate_lines`).

    packs: None = unpacked (every row its own padded line: one per example when sharing, K when not);
           else groups of example indices, one packed line per group (all rows of an example in its line).
    """
    rows = [layout_example(ex, prefix_sharing) for ex in examples]
    if packs is None:
        lines = [[(e, row)] for e, ex_rows in enumerate(rows) for row in ex_rows]
    else:
        lines = [[(e, row) for e in pack for row in rows[e]] for pack in packs]
        seen = sorted(e for pack in packs for e in pack)
        if seen != list(range(len(examples))):
            raise ValueError("packs must hold every example of the batch exactly once")
    return collate_lines(examples, lines, pad_token_id=pad_token_id, length=length, pad_multiple=pad_multiple,
                         bucket=bucket)
