"""The span walk of a line: its runs of columns that a recurrent layer runs in one call, each with its parent run.

A line (`data.lines`) is a forest of token tries laid out depth first: column j's node span is (tin, tout) =
(j, end of j's subtree), (-1, -1) for padding. A recurrent layer's state at a column depends on exactly the column's
ancestors, in order: the column's root-to-node chain. So a run of columns j0..j1 can go through a layer in one call
when each column is the only child of the one before it; the run's initial state is the final state of its parent
column's run (the zero state for a root).

Column j continues the run of column j-1 exactly when tout[j] == tout[j-1]: then j is in j-1's subtree and that
subtree ends where j's does, so j-1 has no other child. Otherwise j starts a run, and the run holding its parent ends
at the parent (the parent has another child, or j is a later sibling), so parents' runs always end at the parent:
their final state is the child's initial state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Run:
    """Columns [start, end) of line `line`, run from the final state of run `parent` (an index into the walk's runs;
    -1: a root, from the zero state)."""

    line: int
    start: int
    end: int
    parent: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SpanWalk:
    """The runs of every line of a [B, L] batch in depth-first (column) order, each run after its parent.

    runs:    the real columns' runs, line by line, in column order
    padding: (line, start, end) of each run of padding columns (no layer output depends on them, nor they on any)
    depth:   [len(runs)] the number of ancestor runs of each run (0: a root)
    """

    runs: tuple[Run, ...]
    padding: tuple[tuple[int, int, int], ...]
    depth: tuple[int, ...]

    @property
    def shape_key(self) -> tuple:
        return tuple((r.line, r.start, r.end, r.parent) for r in self.runs)


def walk_spans(spans: torch.Tensor) -> SpanWalk:
    """The `SpanWalk` of lines with node spans `spans` [B, L, 2] long ((tin, tout) per column, (-1, -1) padding)."""
    tin, tout = spans[..., 0].detach().to("cpu"), spans[..., 1].detach().to("cpu")
    B, L = tout.shape
    real = tout >= 0
    columns = torch.arange(L).expand(B, L)
    if not bool(((tin == columns) & (tout > columns) & (tout <= L))[real].all()):  # the layout `data.lines` builds
        raise ValueError("a recurrent layer's pass plan needs each real column's span (its own column, the end of its "
                         "subtree within the line)")
    # a new run starts at column 0, where realness changes, and where tout differs from the previous column's
    starts = torch.ones(B, L, dtype=torch.bool)
    if L > 1:
        starts[:, 1:] = (tout[:, 1:] != tout[:, :-1]) | (real[:, 1:] != real[:, :-1])
    tout_rows, real_rows, start_rows = tout.tolist(), real.tolist(), starts.tolist()
    runs: list[Run] = []
    padding: list[tuple[int, int, int]] = []
    depth: list[int] = []
    for b in range(B):
        cols = [j for j in range(L) if start_rows[b][j]] + [L]
        open_runs: list[int] = []  # the runs on the path from a root to the current run (by index), deepest last
        for start, end in zip(cols[:-1], cols[1:]):
            if not real_rows[b][start]:
                padding.append((b, start, end))
                continue
            # ancestors are the open runs whose last column's subtree still holds `start`
            while open_runs and tout_rows[b][runs[open_runs[-1]].end - 1] <= start:
                open_runs.pop()
            parent = open_runs[-1] if open_runs else -1
            runs.append(Run(b, start, end, parent))
            depth.append(len(open_runs))
            open_runs.append(len(runs) - 1)
    return SpanWalk(tuple(runs), tuple(padding), tuple(depth))
