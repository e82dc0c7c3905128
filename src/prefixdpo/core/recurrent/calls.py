"""The mixer calls of a span walk: which columns each call runs, from which call's final state, in what batches.

A run (`spans.Run`) is normally one call. One exception, because of how the layers' own code paths are written: a
call of ONE token that starts from a state takes each layer's decode path, and Mamba2's (`mamba2_selective_state_update`
in transformers 5.25) updates the state in place after saving it for backward, so its gradient cannot be taken. So
no call of one token starts from a state:
- a one-token run with children is folded into each child's call (the child's call runs the token, then its own
  columns, from the one-token run's parent's state); the token's output is read from the first child's call;
- a one-token leaf runs its token twice (a call of two columns) and keeps the first output; its final state, which
  the second column spoils, is no one's initial state.
Both are exact: a call's outputs at a column depend only on the columns before it in the call.

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
    state of call `parent` (-1: the zero state)."""

    line: int
    columns: tuple[int, ...]
    parent: int


@dataclass(frozen=True)
class CallPlan:
    """calls:  every call, each after its parent
    groups: lists of call indices of one depth and one length, shallowest first: each one batched mixer call
    index:  [B * L] long, for each column of the lines, its output's row in the groups' outputs flattened in order
            (each group's [n, length, H] as [n * length, H], groups one after another); padding columns point at
            one extra zero row after them
    """

    calls: tuple[Call, ...]
    groups: tuple[tuple[int, ...], ...]
    index: torch.Tensor


def plan_calls(walk: SpanWalk, B: int, L: int) -> CallPlan:
    """The calls of `walk` over [B, L] lines (module docstring)."""
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
        if len(columns) == 1 and parent_call >= 0:
            if children.get(i):
                continue  # folded into each child's call
            columns = columns * 2  # a one-token leaf: run twice, the first output kept
        calls.append(Call(run.line, columns, parent_call))
        depth.append(d)
        call_of_run[i] = len(calls) - 1

    by_key: dict[tuple[int, int], list[int]] = {}
    for c, call in enumerate(calls):
        by_key.setdefault((depth[c], len(call.columns)), []).append(c)
    groups = tuple(tuple(by_key[key]) for key in sorted(by_key))

    total = sum(len(calls[c].columns) for group in groups for c in group)
    index = np.full((B, L), total, dtype=np.int64)  # padding: the zero row after the outputs
    row = 0
    for group in groups:
        for c in group:
            call = calls[c]
            for k, col in enumerate(call.columns):
                if index[call.line, col] == total:  # the first call that runs a column gives its output
                    index[call.line, col] = row + k
            row += len(call.columns)
    return CallPlan(tuple(calls), groups, torch.from_numpy(index.reshape(-1)))
