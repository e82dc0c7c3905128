"""`Rows -> Batch`: lay rows into padded (and optionally packed) lines as the tensors a forward needs.

A *line* is one row of the `[B, L]` batch. Unpacked, each `Row` gets its own line; packed, several
examples' rows share a line, told apart by document ids. Padding has doc id -1.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

from prefixdpo.data.example import Example
from prefixdpo.data.layout import Row, layout_example

PAD_DOC = -1


@dataclass
class Batch:
    """Everything the forward pass and the log-prob gather need (B lines of length L, T targets,
    R responses, P preference pairs; responses are numbered example by example).

    input_ids, position_ids: [B, L] long
    doc_ids:        [B, L] long, document of each token within its line; -1 = padding
    branch_ids:     [B, L] long, 0 = shared prompt, k+1 = response k of that document
    target_line, target_col: [T] long, where the hidden state predicting each response token is
    target_ids:     [T] long, the response tokens
    target_response:[T] long, global response index 0..R-1 of each target
    response_lengths: [R] long, tokens per response
    response_line, response_doc, response_branch: [R] long, where each response's tokens are: the line, the
                    document within it, and the branch (1..K in a prefix-shared row, 1 in a standard row).
                    Recorded here, from the layout, for every reader (MoE token weights, reward score positions).
    pair_better, pair_worse: [P] long, global response indices (better preferred to worse)
    max_sequence_length: longest standard `[prompt][response]` sequence in the batch (sliding-window checks)
    tree_spans:     [B, L, 2] long or None: tree lines (`data.tree`) give each token its node's (tin, tout), and
                    the attention rule is the tree's (ancestors and itself); None: the (document, branch) rule
    response_last:  [R] long or None (set with tree_spans): the column, in line `response_line`, of the last token of
                    each response's `[prompt][response]` sequence. That sequence is exactly the tokens whose span
                    holds this column (the node's ancestors and itself): what reward scores and MoE token weights
                    read on tree lines, where the (document, branch) record says nothing
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    branch_ids: torch.Tensor
    target_line: torch.Tensor
    target_col: torch.Tensor
    target_ids: torch.Tensor
    target_response: torch.Tensor
    response_lengths: torch.Tensor
    response_line: torch.Tensor
    response_doc: torch.Tensor
    response_branch: torch.Tensor
    pair_better: torch.Tensor
    pair_worse: torch.Tensor
    max_sequence_length: int = 0
    tree_spans: torch.Tensor | None = None
    response_last: torch.Tensor | None = None

    @property
    def is_tree(self) -> bool:
        """Lines laid out as token tries (`data.tree`): only a mask that follows the tree may run them."""
        return self.tree_spans is not None

    @property
    def num_pairs(self) -> int:
        return int(self.pair_better.numel())

    @property
    def num_responses(self) -> int:
        return int(self.response_lengths.numel())

    @property
    def num_real_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())

    @property
    def num_slots(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> "Batch":
        return self._with_tensors(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> "Batch":
        """A copy in page-locked memory (`DataLoader(pin_memory=True)` calls this): `to(cuda)` is then asynchronous."""
        return self._with_tensors(lambda t: t.pin_memory())

    def _with_tensors(self, fn) -> "Batch":
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_length(n: int, base: int = 128) -> int:
    """Round `n` up to the next of a few lengths: base x {1, 2, 3, 4, 6, 8, 12, 16, ...} (steps of 1.5-2x).

    Compiled FlexAttention (CUDA) compiles once per line length: bucketing keeps that to a handful.
    """
    blocks = -(-int(n) // base)
    size = 1
    while size < blocks:  # 1, 2, 3, 4, 6, 8, 12, 16, ... : powers of two and 1.5 x powers of two
        size = size * 3 // 2 if size >= 2 and size & (size - 1) == 0 else (size * 4 // 3 if size >= 3 else size + 1)
    return size * base


def _responses_in_order(row: Row) -> list[int]:
    """The example's response indices of `row`, in the order they follow the prompt: the layout gives them
    branches 1, 2, ... in that order (`layout._row`)."""
    return list(dict.fromkeys(row.target_response))


def collate_lines(
    examples: Sequence[Example],
    lines: Sequence[Sequence[tuple[int, Row]]],
    *,
    pad_token_id: int = 0,
    length: int | None = None,
    pad_multiple: int = 1,
    bucket: bool = False,
) -> Batch:
    """Build a Batch from lines of (example index, Row); every row of an example must be in this batch.

    length: fixed line length (e.g. the pack length); default the longest line rounded up to pad_multiple,
            or to `bucket_length` when `bucket`.
    """
    response_offset = [0]
    for ex in examples:
        response_offset.append(response_offset[-1] + ex.num_responses)

    longest = max((sum(len(r) for _, r in line) for line in lines), default=1)
    if length is not None:
        L = length
    elif bucket:
        L = bucket_length(max(longest, 1))
    else:
        L = _round_up(max(longest, 1), pad_multiple)
    if longest > L:
        raise ValueError(f"a line holds {longest} tokens, more than the line length {L}")
    B = len(lines)
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((B, L), dtype=torch.long)
    doc_ids = torch.full((B, L), PAD_DOC, dtype=torch.long)
    branch_ids = torch.zeros((B, L), dtype=torch.long)
    t_line: list[int] = []
    t_col: list[int] = []
    t_ids: list[int] = []
    t_resp: list[int] = []
    R = response_offset[-1]
    r_line, r_doc, r_branch = [-1] * R, [-1] * R, [-1] * R
    for b, line in enumerate(lines):
        start = 0
        for doc, (e, row) in enumerate(line):
            for branch, k in enumerate(_responses_in_order(row), start=1):
                r = response_offset[e] + k
                r_line[r], r_doc[r], r_branch[r] = b, doc, branch
            n = len(row)
            end = start + n
            input_ids[b, start:end] = torch.tensor(row.input_ids)
            position_ids[b, start:end] = torch.tensor(row.position_ids)
            branch_ids[b, start:end] = torch.tensor(row.branch_ids)
            doc_ids[b, start:end] = doc
            t_line.extend([b] * len(row.target_ids))
            t_col.extend(start + i for i in row.target_index)
            t_ids.extend(row.target_ids)
            t_resp.extend(response_offset[e] + k for k in row.target_response)
            start = end
    if -1 in r_line:
        raise ValueError(f"response {r_line.index(-1)} of the batch is in none of its lines")

    response_lengths = torch.tensor([len(r) for ex in examples for r in ex.response_ids], dtype=torch.long)
    better = [response_offset[e] + i for e, ex in enumerate(examples) for i, _ in ex.pairs]
    worse = [response_offset[e] + j for e, ex in enumerate(examples) for _, j in ex.pairs]
    max_seq = max(
        (len(ex.prompt_ids) + len(r) for ex in examples for r in ex.response_ids), default=0
    )
    return Batch(
        input_ids=input_ids,
        position_ids=position_ids,
        doc_ids=doc_ids,
        branch_ids=branch_ids,
        target_line=torch.tensor(t_line, dtype=torch.long),
        target_col=torch.tensor(t_col, dtype=torch.long),
        target_ids=torch.tensor(t_ids, dtype=torch.long),
        target_response=torch.tensor(t_resp, dtype=torch.long),
        response_lengths=response_lengths,
        response_line=torch.tensor(r_line, dtype=torch.long),
        response_doc=torch.tensor(r_doc, dtype=torch.long),
        response_branch=torch.tensor(r_branch, dtype=torch.long),
        pair_better=torch.tensor(better, dtype=torch.long),
        pair_worse=torch.tensor(worse, dtype=torch.long),
        max_sequence_length=max_seq,
    )


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
