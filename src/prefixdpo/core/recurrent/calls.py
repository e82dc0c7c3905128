"""The mixer calls of a span walk: which columns each call runs, from which call's final state, in what batches.

A run (`spans.Run`) is normally one call. One exception, because of how the layers' own code paths are written: a
call of ONE token that starts from a state takes each layer's decode path, and Mamba2's (`mamba2_selective_state_update`
in transformers 5.25) updates the state in place after saving it for backward, so its gradient cannot be taken. So
no call of one token starts from a state:
- a one-token run with children is folded into each child's call (the child's call runs the token, then its own
  columns, from the one-token run's parent's state); the token's output is read from the first child's call;
- a one-token leaf is run with a second column (below).
Both are exact: a call's outputs at a column depend only on the columns before it in the call.

Leaves (calls whose final state is no one's initial state: the responses of a DPO line, a GRPO group's completions)
run as ONE batch whatever their lengths and depths, after every other call (the roots that are leaves, from no state,
as one more): each is padded on the right to the longest (at least two columns when they start from a state) by
repeating its last column; the padding's outputs are dropped, and the final states it spoils are never read. Other
calls are batched by depth and length, unpadded, since their final states are their children's initial states.

`CallPlan.index` puts the calls' outputs back in column order with one gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prefixdpo.core.recurrent.spans import SpanWalk


@dataclass(frozen=True)
class Call:
    """One row of a mixer call: line `line`'s columns `columns` (a root-to-node chain, in order), from the final
    state of call `parent` (-1: the zero state); `leaf`: no call starts from its final state."""

    line: int
    columns: tuple[int, ...]
    parent: int
    leaf: bool


@dataclass(frozen=True)
class CallPlan:
    """calls:  every call, each after its parent
    groups: lists of call indices, each one batched mixer call, shallowest first (module docstring)
    widths: each group's number of columns (its calls' length; for leaves, the longest, padded)
    rows:   each group's input rows: [n * width] long indices into the lines' columns flattened ([B * L])
    index:  [B * L] long, for each column of the lines, its output's row in the groups' outputs flattened in order
            (each group's [n, width, H] as [n * width, H], groups one after another); the lines' padding columns
            point at one extra zero row after them
    """

    calls: tuple[Call, ...]
    groups: tuple[tuple[int, ...], ...]
    widths: tuple[int, ...]
    rows: tuple[torch.Tensor, ...]
    index: torch.Tensor


def plan_calls(walk: SpanWalk, B: int, L: int, roots_from_state: bool = False) -> CallPlan:
    """The calls of `walk` over [B, L] lines (module docstring). roots_from_state: the roots start from a state too
    (a chunk of prefix reuse, from its prefix's final states), so a one-token root is folded or padded as any call
    from a state."""
    children: dict[int, list[int]] = {}
    for i, run in enumerate(walk.runs):
        children.setdefault(run.parent, []).append(i)
    calls: list[Call] = []
    depth: list[int] = []
    call_of_run: dict[int, int] = {}  # run -> the call whose final state is the run's final state
    # (prefix columns folded from one-token ancestors, the call those start from, its depth) per run
    start_of: dict[int, tuple[tuple[int, ...], int, int]] = {}
    for i, run in enumerate(walk.runs):  # parents come before children
        if run.parent < 0:
            prefix, parent_call, d = (), -1, 0
        elif run.parent in start_of and run.parent not in call_of_run:  # the parent was folded into its children
            prefix, parent_call, d = start_of[run.parent]
            prefix = prefix + tuple(range(walk.runs[run.parent].start, walk.runs[run.parent].end))
        else:
            prefix, parent_call, d = (), call_of_run[run.parent], depth[call_of_run[run.parent]] + 1
        start_of[i] = (prefix, parent_call, d)
        columns = prefix + tuple(range(run.start, run.end))
        leaf = not children.get(i)
        if len(columns) == 1 and (parent_call >= 0 or roots_from_state) and not leaf:
            continue  # folded into each child's call
        calls.append(Call(run.line, columns, parent_call, leaf))
        depth.append(d)
        call_of_run[i] = len(calls) - 1

    by_key: dict[tuple[int, int], list[int]] = {}
    last = max(depth, default=0) + 1
    for c, call in enumerate(calls):  # non-leaves by depth and length; root leaves together; then all other leaves
        key = (0 if call.parent < 0 else last, -1) if call.leaf else (depth[c], len(call.columns))
        by_key.setdefault(key, []).append(c)
    groups = tuple(tuple(by_key[key]) for key in sorted(by_key))
    widths = tuple(max(max(len(calls[c].columns) for c in group),
                       2 if calls[group[0]].parent >= 0 or roots_from_state else 1) for group in groups)

    index = np.full((B, L), sum(len(g) * w for g, w in zip(groups, widths)), dtype=np.int64)  # padding: zero row
    rows, out_row = [], 0
    for group, width in zip(groups, widths):
        group_rows = []
        for c in group:
            call = calls[c]
            columns = call.columns + call.columns[-1:] * (width - len(call.columns))  # leaves padded on the right
            group_rows += [call.line * L + col for col in columns]
            for k, col in enumerate(call.columns):
                if index[call.line, col] > out_row + k:  # the first call that runs a column gives its output
                    index[call.line, col] = out_row + k
            out_row += width
        rows.append(torch.tensor(group_rows, dtype=torch.long))
    return CallPlan(tuple(calls), groups, widths, tuple(rows), torch.from_numpy(index.reshape(-1)))
