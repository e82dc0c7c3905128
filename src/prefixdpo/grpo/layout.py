"""TRL's group rows -> prefix-shared lines: each prompt once, the completions sampled from it as branches.

TRL 1.16's GRPO/RLOO log-prob passes take rows ``[left-padded prompt][right-padded completion]``
(`input_ids`, `attention_mask` [N, L]) and score the last `logits_to_keep` = K columns: the completion.
Here the rows are grouped by their prompt tokens (the non-pad ids *and* the columns they sit in, so
never by row order: TRL shuffles rows between generation and training) and each group becomes one
prefix-shared row, packed with other groups into lines::

    line:      [ prompt (non-pad) ][ completion a ][ completion b ] ... [ next group's prompt ] ...
    position:    TRL's own position of each token (its column), so every token sees what it saw in TRL's row
    branch:      0                   1               2                    0 ...
    doc:         0                   0               0                    1 ...

The token in TRL column P+j (P = L - K) is predicted by the hidden state one column before it: for j = 0
the prompt's last column, shared by the whole group; for j > 0 the completion's own previous token.
Padding columns (attention_mask 0) are left out, which is exact: in TRL's row no real token attends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixdpo.data.batch import PAD_DOC, bucket_length

from prefixdpo.data.packing import auto_pack_length, plan_packs

# Models whose forward derives positions from the padding mask (its running count) when given none,
# instead of transformers' default `arange` over columns (absolute-position models; for rotary ones the
# two agree up to rounding, as only differences of positions enter attention).
MASK_POSITION_MODEL_TYPES = frozenset({"opt", "biogpt"})


@dataclass
class GroupLines:
    """One log-prob pass of TRL's N rows laid out as B prefix-shared lines of S slots (T scored tokens).

    input_ids, position_ids: [B, S] long
    doc_ids:      [B, S] long, group of each slot within its line; -1 = padding
    branch_ids:   [B, S] long, 0 = the shared prompt, k >= 1 = the group's k-th row's completion
    target_line, target_col: [T] long, the slot whose hidden state predicts each scored token (line order)
    target_ids:   [T] long, the scored tokens
    out_row, out_col: [T] long, where each result goes in TRL's [N, K] output
    slot_row:     [B, S] long, TRL row of each completion slot; -1 for prompt slots and padding
    slot_group:   [B, S] long, group of each prompt slot; -1 for completion slots and padding
    group_of_row: [N] long, the group of each TRL row (rows with equal prompt tokens share one)
    trl_tokens:   real tokens of TRL's rows (its attention mask's ones): what sharing is measured against
    masks:        attention masks built for these lines, by (first line, end line, backend): a pass over the same
                  rows (TRL's reference and old-policy passes, the policy's) reuses them
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    branch_ids: torch.Tensor
    target_line: torch.Tensor
    target_col: torch.Tensor
    target_ids: torch.Tensor
    out_row: torch.Tensor
    out_col: torch.Tensor
    slot_row: torch.Tensor
    slot_group: torch.Tensor
    group_of_row: torch.Tensor
    num_rows: int
    logits_to_keep: int
    trl_tokens: int
    masks: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_lines(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_real_tokens(self) -> int:
        return int((self.doc_ids != PAD_DOC).sum())


def why_not_shared(attention_mask: torch.Tensor, logits_to_keep: int) -> str | None:
    """Why TRL's rows cannot be laid out exactly as prefix-shared lines (None = they can).

    attention_mask: [N, L] TRL's mask (prompt mask, then completion mask); logits_to_keep: K.
    A completion must be attended as one unbroken run from its first token (TRL masks after EOS, or
    the whole of a truncated completion), and a completion token's predictor must be a real token.
    """
    L = attention_mask.shape[1]
    K = int(logits_to_keep)
    if not 1 <= K < L:
        return f"logits_to_keep={K} with rows of {L} columns leaves no prompt"
    mask = attention_mask.bool()
    completion = mask[:, L - K:]
    lengths = completion.sum(1)
    if not torch.equal(completion, torch.arange(K, device=mask.device)[None, :] < lengths[:, None]):
        return "a completion mask attends a token after a masked one"
    if bool(((lengths > 0) & ~mask[:, L - K - 1]).any()):
        return "a completion follows a masked prompt column"
    return None


def trl_positions(attention_mask: torch.Tensor, from_mask: bool) -> torch.Tensor:
    """The position TRL's forward gives each cell of its rows. [N, L] -> [N, L] long.

    transformers' default (no position_ids passed, as TRL passes none) is the column; models in
    `MASK_POSITION_MODEL_TYPES` count the real tokens before it instead (`from_mask`).
    """
    N, L = attention_mask.shape
    if from_mask:
        return (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    return torch.arange(L, device=attention_mask.device).expand(N, L)


def _group_rows(input_ids: torch.Tensor, mask: torch.Tensor, prompt_width: int) -> tuple[torch.Tensor, list[list[int]]]:
    """(group of each row [N], the rows of each group in row order): rows are grouped by their prompt's
    non-pad tokens and the columns those sit in (pad cells read as -1)."""
    keys = input_ids[:, :prompt_width].masked_fill(~mask[:, :prompt_width], -1)
    _, group_of_row = torch.unique(keys, dim=0, return_inverse=True)
    members: list[list[int]] = [[] for _ in range(int(group_of_row.max()) + 1)]
    for row, group in enumerate(group_of_row.tolist()):
        members[group].append(row)
    return group_of_row, members


def _line_groups(lengths: list[int], packing: bool, pack_length: int | str) -> list[list[int]]:
    """Which groups share each line: best-fit packs of at most `pack_length` tokens ('auto': 1.1 x the 95th
    percentile of group lengths, rounded up to 128), or one group per line. A group longer than an explicit
    pack length gets a line of its own (TRL's batch decides the rows; none may be dropped)."""
    groups = [g for g, n in enumerate(lengths) if n > 0]
    if not packing or not groups:
        return [[g] for g in groups]
    sizes = [lengths[g] for g in groups]
    length = auto_pack_length(sizes) if pack_length == "auto" else max(int(pack_length), max(sizes))
    return [[groups[i] for i in pack] for pack in plan_packs(sizes, length, shuffle=False)]


def layout_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    positions_from_mask: bool = False,
    packing: bool = True,
    pack_length: int | str = "auto",
    bucket: bool = False,
) -> GroupLines:
    """Lay TRL's rows out as prefix-shared lines (call `why_not_shared` first: its rows must pass).

    input_ids, attention_mask: [N, L] TRL's rows; logits_to_keep: K, the completion columns.
    positions_from_mask: the model counts positions over real tokens (see `trl_positions`).
    packing / pack_length: several groups per line (see `_line_groups`); bucket: round the line length up to
    one of a few sizes (multiples of 128, as compiled FlexAttention wants), else to the longest line.
    Index bookkeeping runs on the CPU; the returned tensors live on `input_ids.device`.
    """
    device = input_ids.device
    ids = input_ids.detach().cpu()
    mask = attention_mask.detach().cpu().bool()
    N, L = ids.shape
    K = int(logits_to_keep)
    P = L - K
    completion_lengths = mask[:, P:].sum(1).tolist()
    group_of_row, members = _group_rows(ids, mask, P)
    prompt_cols = [mask[rows[0], :P].nonzero().squeeze(1) for rows in members]
    lengths = [len(cols) + sum(completion_lengths[r] for r in rows) for cols, rows in zip(prompt_cols, members)]
    lines = _line_groups(lengths, packing, pack_length)

    longest = max((sum(lengths[g] for g in line) for line in lines), default=1)
    S = bucket_length(longest) if bucket else longest
    B = max(len(lines), 1)
    src_row = torch.zeros(B, S, dtype=torch.long)
    src_col = torch.zeros(B, S, dtype=torch.long)
    doc_ids = torch.full((B, S), PAD_DOC, dtype=torch.long)
    branch_ids = torch.zeros(B, S, dtype=torch.long)
    slot_row = torch.full((B, S), -1, dtype=torch.long)
    slot_group = torch.full((B, S), -1, dtype=torch.long)
    t_line, t_col, out_row, out_col = [], [], [], []
    for b, line in enumerate(lines):
        start = 0
        for doc, g in enumerate(line):
            cols = prompt_cols[g]
            end = start + len(cols)
            src_row[b, start:end] = members[g][0]
            src_col[b, start:end] = cols
            doc_ids[b, start:end] = doc
            slot_group[b, start:end] = g
            last_prompt_slot = end - 1
            for branch, row in enumerate(members[g], start=1):
                n = completion_lengths[row]
                if n == 0:  # fully masked (e.g. mask_truncated_completions): nothing scored, nothing attended
                    continue
                span = slice(end, end + n)  # slices, not index tensors: a step lays out every row in Python
                src_row[b, span] = row
                src_col[b, span] = torch.arange(P, P + n)
                doc_ids[b, span] = doc
                branch_ids[b, span] = branch
                slot_row[b, span] = row
                t_line.append(torch.full((n,), b))
                # token 0 is predicted by the prompt's last slot, token j > 0 by this completion's token j-1
                t_col.append(torch.arange(end - 1, end + n - 1))
                t_col[-1][0] = last_prompt_slot
                out_row.append(torch.full((n,), row))
                out_col.append(torch.arange(n))
                end += n
            start = end

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)

    out_row_t, out_col_t = cat(out_row), cat(out_col)
    positions = trl_positions(mask, positions_from_mask)
    real = doc_ids != PAD_DOC
    return GroupLines(
        input_ids=torch.where(real, ids[src_row, src_col], 0).to(device),
        position_ids=torch.where(real, positions[src_row, src_col], 0).to(device),
        doc_ids=doc_ids.to(device),
        branch_ids=branch_ids.to(device),
        target_line=cat(t_line).to(device),
        target_col=cat(t_col).to(device),
        target_ids=ids[out_row_t, P + out_col_t].to(device),
        out_row=out_row_t.to(device),
        out_col=out_col_t.to(device),
        slot_row=slot_row.to(device),
        slot_group=slot_group.to(device),
        group_of_row=group_of_row.to(device),
        num_rows=N,
        logits_to_keep=K,
        trl_tokens=int(mask.sum()),
    )


def line_chunks(lines: GroupLines, max_slots: int) -> list[tuple[int, int]]:
    """Consecutive line ranges [start, end) of at most `max_slots` slots each (at least one line): one forward
    each, so a pass never holds more activations than TRL's own chunk of rows (`batch_size` x L)."""
    S = max(lines.input_ids.shape[1], 1)
    per_chunk = max(1, int(max_slots) // S)
    return [(a, min(a + per_chunk, lines.num_lines)) for a in range(0, lines.num_lines, per_chunk)]


def aux_token_weights(lines: GroupLines, rows: torch.Tensor) -> torch.Tensor:
    """How many times TRL's rows `rows` hold each slot's token as a real (attended) token. -> [B, S] fp32.

    TRL's MoE load-balancing loss averages over the real tokens of the rows in one forward; a shared
    prompt token stands for each of its group's rows there, a completion token for its own row.
    rows: [M] long, TRL row indices of one of its forwards.
    """
    in_rows = torch.zeros(lines.num_rows, dtype=torch.float32, device=lines.slot_row.device)
    in_rows[rows] = 1.0
    per_group = torch.zeros(int(lines.group_of_row.max()) + 1 if lines.num_rows else 1,
                            dtype=torch.float32, device=in_rows.device).index_add_(0, lines.group_of_row, in_rows)
    from_completion = in_rows[lines.slot_row.clamp(min=0)]
    from_prompt = per_group[lines.slot_group.clamp(min=0)]
    return torch.where(lines.slot_row >= 0, from_completion, torch.where(lines.slot_group >= 0, from_prompt, 0.0))
