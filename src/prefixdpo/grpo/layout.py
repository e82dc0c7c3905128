"""TRL's group rows -> prefix-shared lines: each prompt once, the completions sampled from it as branches.

TRL 1.16's GRPO/RLOO log-prob passes take rows ``[left-padded prompt][right-padded completion]``
(`input_ids`, `attention_mask` [N, L]) and score the last `logits_to_keep` = K columns: the completion.
Here the rows are grouped by their prompt tokens (the non-pad ids *and* the columns they sit in, so
never by row order: TRL shuffles rows between generation and training) and each group becomes one
prefix-shared row, packed with other groups into lines::

    line:      [ prompt (non-pad) ][ completion a ][ completion b ] ... [ next group's prompt ] ...
    position:    TRL's own position of each token (its column), so every token sees what it saw in TRL's row
    subtree:     the group's end        a's end          b's end              ...

a depth-1 trie per group (`data.lines`: the one layout every pass runs, built by the one collate).

The token in TRL column P+j (P = L - K) is predicted by the hidden state one column before it: for j = 0
the prompt's last column, shared by the whole group; for j > 0 the completion's own previous token.
Padding columns (attention_mask 0) are left out, which is exact: in TRL's row no real token attends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixdpo.data.layout import prefix_row
from prefixdpo.data.lines import Lines, Row, collate, sequence_counts
from prefixdpo.data.packing import auto_pack_length, plan_packs

# Models whose forward derives positions from the padding mask (its running count) when given none,
# instead of transformers' default `arange` over columns (absolute-position models; for rotary ones the
# two agree up to rounding, as only differences of positions enter attention).
MASK_POSITION_MODEL_TYPES = frozenset({"opt", "biogpt"})


@dataclass
class GroupLines(Lines):
    """One log-prob pass of TRL's N rows laid out as B prefix-shared lines (`Lines`: T scored tokens; each TRL row's
    completion is one response, numbered by its row, so `target_response` is the row a result goes to).

    out_col:      [T] long, where each result goes in its row of TRL's [N, K] output (its position in the completion)
    num_rows, logits_to_keep: N and K
    trl_tokens:   real tokens of TRL's rows (its attention mask's ones): what sharing is measured against
    masks:        attention masks built for these lines, by (first line, end line, backend): a pass over the same
                  rows (TRL's reference and old-policy passes, the policy's) reuses them
    """

    out_col: torch.Tensor
    num_rows: int
    logits_to_keep: int
    trl_tokens: int
    masks: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def out_row(self) -> torch.Tensor:
        """[T] long: the TRL row of each result."""
        return self.target_response


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


def _group_rows(input_ids: torch.Tensor, mask: torch.Tensor, prompt_width: int) -> list[list[int]]:
    """The rows of each group, in row order: rows are grouped by their prompt's non-pad tokens and the columns
    those sit in (pad cells read as -1)."""
    keys = input_ids[:, :prompt_width].masked_fill(~mask[:, :prompt_width], -1)
    _, group_of_row = torch.unique(keys, dim=0, return_inverse=True)
    members: list[list[int]] = [[] for _ in range(int(group_of_row.max()) + 1)]
    for row, group in enumerate(group_of_row.tolist()):
        members[group].append(row)
    return members


def _line_groups(lengths: list[int], packing: bool, pack_length: int | str) -> list[list[int]]:
    """Which groups share each line: best-fit packs of at most `pack_length` tokens ('auto': 1.1 x the 95th
    percentile of group lengths, rounded up to 128), or one group per line. A group longer than an explicit
    pack length gets a line of its own (TRL's batch decides the rows; none may be dropped). Groups without a real
    token (their rows hold nothing to score) join the last line."""
    groups = [g for g, n in enumerate(lengths) if n > 0]
    empty = [g for g, n in enumerate(lengths) if n == 0]
    if not packing or not groups:
        lines = [[g] for g in groups]
    else:
        sizes = [lengths[g] for g in groups]
        length = auto_pack_length(sizes) if pack_length == "auto" else max(int(pack_length), max(sizes))
        lines = [[groups[i] for i in pack] for pack in plan_packs(sizes, length, shuffle=False)]
    if empty:
        lines = lines[:-1] + [(lines[-1] if lines else []) + empty]
    return lines


def _group_row(ids: list[list[int]], positions: list[list[int]], prompt_cols: list[int], rows: list[int],
               completion_lengths: list[int], P: int) -> Row:
    """The depth-1 trie of one group (its prompt's real tokens, then each row's completion, numbered by its place in
    `rows`), at TRL's positions. ids, positions: TRL's rows as lists; prompt_cols: the prompt's real columns."""
    first = rows[0]
    prompt = [ids[first][c] for c in prompt_cols]
    completions = [(k, ids[row][P:P + completion_lengths[row]]) for k, row in enumerate(rows)]
    own_positions = [positions[first][c] for c in prompt_cols]
    for row in rows:
        own_positions.extend(positions[row][P:P + completion_lengths[row]])
    return prefix_row(prompt, completions, own_positions)


def _rank_in_run(values: torch.Tensor) -> torch.Tensor:
    """[T] -> [T] long: each entry's place in its run of equal consecutive values (0, 1, ... per run)."""
    T = values.numel()
    index = torch.arange(T)
    starts = torch.ones(T, dtype=torch.bool)
    starts[1:] = values[1:] != values[:-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=0).values if T else index


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
    ids = input_ids.detach().cpu()
    mask = attention_mask.detach().cpu().bool()
    N, L = ids.shape
    K = int(logits_to_keep)
    P = L - K
    completion_lengths = mask[:, P:].sum(1).tolist()
    members = _group_rows(ids, mask, P)
    ids_list, positions = ids.tolist(), trl_positions(mask, positions_from_mask).tolist()
    groups = [_group_row(ids_list, positions, mask[rows[0], :P].nonzero().squeeze(1).tolist(), rows,
                         completion_lengths, P) for rows in members]
    lines = _line_groups([len(row) for row in groups], packing, pack_length)
    fields = collate([[(groups[g], members[g]) for g in line] for line in lines], N, bucket=bucket)
    device = input_ids.device
    return GroupLines(
        **{name: t.to(device) for name, t in fields.items()},
        out_col=_rank_in_run(fields["target_response"]).to(device),
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
    prompt token stands for each of its group's rows there, a completion token for its own row: the rows whose
    sequence passes through the slot (`lines.sequence_counts`).
    rows: [M] long, TRL row indices of one of its forwards.
    """
    in_rows = torch.zeros(lines.num_rows, dtype=torch.float32, device=lines.input_ids.device)
    in_rows[rows] = 1.0
    return sequence_counts(lines, in_rows)
