"""Example -> Row -> Batch: positions restart, branches, and where each target is predicted."""

import torch

from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo.data.layout import separate_rows, shared_row


def test_shared_row_layout_by_hand():
    ex = Example([10, 11, 12], [[20, 21], [30, 31, 32]])
    row = shared_row(ex)
    assert row.input_ids == (10, 11, 12, 20, 21, 30, 31, 32)
    assert row.position_ids == (0, 1, 2, 3, 4, 3, 4, 5)
    assert row.branch_ids == (0, 0, 0, 1, 1, 2, 2, 2)
    # the prompt's last position (2) predicts the first token of every response; no duplicated token
    assert row.target_index == (2, 3, 2, 5, 6)
    assert row.target_ids == (20, 21, 30, 31, 32)
    assert row.target_response == (0, 0, 1, 1, 1)


def test_separate_rows_are_plain_sequences():
    ex = Example([10, 11], [[20], [30, 31]])
    a, b = separate_rows(ex)
    assert a.input_ids == (10, 11, 20) and a.position_ids == (0, 1, 2) and a.target_index == (1,)
    assert b.input_ids == (10, 11, 30, 31) and b.target_index == (1, 2) and b.target_response == (1, 1)


def test_packed_batch_docs_padding_and_global_indices():
    exs = [Example([1, 2], [[3], [4, 5]]), Example([6], [[7, 8], [9], [10]], pairs=[(2, 0), (2, 1)])]
    batch = build_batch(exs, packs=[[0, 1]], length=16)
    assert batch.input_ids.shape == (1, 16)
    assert batch.doc_ids[0].tolist() == [0] * 5 + [1] * 5 + [-1] * 6
    assert batch.num_real_tokens == 10
    assert batch.response_lengths.tolist() == [1, 2, 2, 1, 1]
    # pairs refer to global response indices: example 1's responses are 2, 3, 4
    assert batch.pair_better.tolist() == [0, 4, 4] and batch.pair_worse.tolist() == [1, 2, 3]
    # responses are numbered example by example: every target of response r sits in its example's document
    docs = batch.doc_ids[batch.target_line, batch.target_col]
    assert [docs[batch.target_response == r].unique().tolist() for r in range(5)] == [[0], [0], [1], [1], [1]]
    # the second document's prompt (position 5 in the line) predicts the first token of each of its responses
    firsts = batch.target_col[torch.tensor([3, 5, 6])].tolist()
    assert firsts == [5, 5, 5]
    assert batch.max_sequence_length == 4  # [1, 2] + [4, 5]


def test_unshared_batch_has_one_line_per_response():
    exs = [Example([1, 2], [[3], [4, 5]])]
    batch = build_batch(exs, prefix_sharing=False)
    assert batch.input_ids.shape == (2, 4)
    assert batch.doc_ids.tolist() == [[0, 0, 0, -1], [0, 0, 0, 0]]


def test_bucketed_lines_take_few_lengths():
    """With bucket=True (flex on CUDA), unpacked line lengths fall on a handful of values."""
    from prefixdpo.data.batch import bucket_length

    lengths = set()
    for n in range(1, 40):
        ex = Example(list(range(1, n + 1)), [[5] * n, [6] * (n // 2 + 1)])
        batch = build_batch([ex], bucket=True)
        assert batch.input_ids.shape[1] == bucket_length(ex.shared_length) >= ex.shared_length
        lengths.add(batch.input_ids.shape[1])
    assert lengths == {128}
