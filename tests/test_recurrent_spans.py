"""The span walk and the call plan of `core.recurrent`: which columns a recurrent layer runs together, from which
state (`spans.walk_spans`, `calls.plan_calls`), on the lines prefixdpo lays out (`core.verify.verify_batch`)."""

from __future__ import annotations

import pytest
import torch

from prefixdpo.core.recurrent.calls import plan_calls
from prefixdpo.core.recurrent.spans import Run, walk_spans
from prefixdpo.core.verify import verify_batch
from prefixdpo.data.example import Example


def _example(prompt: int, *responses: int, start: int = 3) -> Example:
    ids = iter(range(start, 1000))
    return Example(tuple(next(ids) for _ in range(prompt)),
                   tuple(tuple(next(ids) for _ in range(n)) for n in responses), ((0, 1),))


def test_a_prefix_shared_line_is_a_prompt_run_and_one_run_per_response_from_its_end():
    batch = verify_batch([_example(4, 3, 2, 5)])
    walk = walk_spans(batch.spans)
    assert walk.runs == (Run(0, 0, 4, -1), Run(0, 4, 7, 0), Run(0, 7, 9, 0), Run(0, 9, 14, 0))
    assert walk.depth == (0, 1, 1, 1) and walk.padding == ()


def test_packed_documents_are_roots_and_padding_is_no_run():
    batch = verify_batch([_example(3, 2, 2), _example(2, 1, 3, start=40)], packs=[[0, 1]], pad_multiple=8)
    walk = walk_spans(batch.spans)
    assert [(r.start, r.end, r.parent) for r in walk.runs] == [(0, 3, -1), (3, 5, 0), (5, 7, 0),
                                                              (7, 9, -1), (9, 10, 3), (10, 13, 3)]
    assert walk.padding == ((0, 13, 16),)


def test_a_trie_across_records_runs_each_node_from_its_parent_node():
    system = (3, 4, 5)
    examples = [Example(system + (10, 11), ((20, 21), (22,)), ((0, 1),)),
                Example(system + (12,), ((23, 24, 25), (26, 27)), ((0, 1),))]
    batch = verify_batch(examples, tree=True)
    walk = walk_spans(batch.spans)
    ids = batch.input_ids[0].tolist()
    chains = [(tuple(ids[r.start:r.end]), tuple(ids[walk.runs[r.parent].start:walk.runs[r.parent].end])
               if r.parent >= 0 else None) for r in walk.runs]
    assert chains == [((3, 4, 5), None), ((10, 11), (3, 4, 5)), ((20, 21), (10, 11)), ((22,), (10, 11)),
                      ((12,), (3, 4, 5)), ((23, 24, 25), (12,)), ((26, 27), (12,))]
    assert walk.depth == (0, 1, 2, 2, 1, 2, 2)


def test_no_call_of_one_token_starts_from_a_state():
    """A one-token node with children is folded into its children's calls; a one-token leaf is padded to two
    columns; leaves of a depth run as one batch padded on the right, other calls by depth and length."""
    system = (3, 4, 5)
    examples = [Example(system + (10, 11), ((20, 21), (22,)), ((0, 1),)),
                Example(system + (12,), ((23, 24, 25), (26, 27)), ((0, 1),))]
    batch = verify_batch(examples, tree=True)
    B, L = batch.input_ids.shape
    plan = plan_calls(walk_spans(batch.spans), B, L)
    ids = batch.input_ids[0].tolist()
    calls = [(tuple(ids[c] for c in call.columns), call.parent) for call in plan.calls]
    assert calls == [((3, 4, 5), -1), ((10, 11), 0), ((20, 21), 1), ((22,), 1), ((12, 23, 24, 25), 0),
                     ((12, 26, 27), 0)]
    assert [call.leaf for call in plan.calls] == [False, False, True, True, True, True]
    # the root; the node (10, 11); all leaves (depth 2 after the folded node 12) in one call of 4 columns
    assert plan.groups == ((0,), (1,), (2, 3, 4, 5)) and plan.widths == (3, 2, 4)
    rows = [ids[r] for r in plan.rows[2].tolist()]
    assert rows == [20, 21, 21, 21, 22, 22, 22, 22, 12, 23, 24, 25, 12, 26, 27, 27]
    # every column's output comes from the first call's position holding that column
    flat_columns = [col for rows in plan.rows for col in rows.tolist()]
    assert [flat_columns[i] for i in plan.index.tolist()] == list(range(L))


def test_standard_rows_are_one_run_each():
    batch = verify_batch([_example(3, 2, 4)], prefix_sharing=False)
    walk = walk_spans(batch.spans)
    assert [(r.line, r.start, r.end, r.parent) for r in walk.runs] == [(0, 0, 5, -1), (1, 0, 7, -1)]
    assert walk.padding == ((0, 5, 7),)
    plan = plan_calls(walk, *batch.input_ids.shape)
    assert plan.groups == ((0, 1),) and plan.widths == (7,)  # two leaf roots: one call, the shorter padded
    assert plan.index.tolist()[5:7] == [14, 14]  # the line's padding reads the zero row after the 2 x 7 outputs


def test_spans_that_are_not_a_depth_first_layout_are_refused():
    spans = torch.tensor([[[0, 3], [2, 3], [2, 3]]])  # column 1 claims column 2's node
    with pytest.raises(ValueError, match="each real column's span"):
        walk_spans(spans)
