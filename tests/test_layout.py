"""Example -> Row -> Batch: positions restart, the trie spans, and where each target is predicted."""

import torch

from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo.data.layout import separate_rows, shared_row


def test_shared_row_layout_by_hand():
    ex = Example([10, 11, 12], [[20, 21], [30, 31, 32]])
    row = shared_row(ex)
    assert row.input_ids == (10, 11, 12, 20, 21, 30, 31, 32)
    assert row.position_ids == (0, 1, 2, 3, 4, 3, 4, 5)
    # a depth-1 trie: every prompt token's subtree is the whole row, each response a chain of its own
    assert row.tout == (8, 8, 8, 5, 5, 8, 8, 8)
    assert row.responses == (0, 1) and row.response_last == (4, 7)
    # the prompt's last position (2) predicts the first token of every response; no duplicated token
    assert row.target_index == (2, 3, 2, 5, 6)
    assert row.target_ids == (20, 21, 30, 31, 32)
    assert row.target_response == (0, 0, 1, 1, 1)


def test_separate_rows_are_plain_sequences():
    ex = Example([10, 11], [[20], [30, 31]])
    a, b = separate_rows(ex)
    assert a.input_ids == (10, 11, 20) and a.position_ids == (0, 1, 2) and a.target_index == (1,)
    assert b.input_ids == (10, 11, 30, 31) and b.target_index == (1, 2) and b.target_response == (1, 1)
    assert a.tout == (3, 3, 3) and b.tout == (4, 4, 4, 4) and b.responses == (1,)  # one chain each


def test_packed_batch_docs_padding_and_global_indices():
    exs = [Example([1, 2], [[3], [4, 5]]), Example([6], [[7, 8], [9], [10]], pairs=[(2, 0), (2, 1)])]
    batch = build_batch(exs, packs=[[0, 1]], length=16)
    assert batch.input_ids.shape == (1, 16)
    # two tries side by side, then padding: each slot's (tin, tout)
    assert batch.spans[0, :, 0].tolist() == list(range(10)) + [-1] * 6
    assert batch.spans[0, :, 1].tolist() == [5, 5, 3, 5, 5] + [10, 8, 8, 9, 10] + [-1] * 6
    assert batch.num_real_tokens == 10
    assert batch.response_lengths.tolist() == [1, 2, 2, 1, 1]
    # pairs refer to global response indices: example 1's responses are 2, 3, 4
    assert batch.pair_better.tolist() == [0, 4, 4] and batch.pair_worse.tolist() == [1, 2, 3]
    # responses are numbered example by example: every target of response r is predicted inside its example's trie
    trie = (batch.target_col >= 5).long()
    assert [trie[batch.target_response == r].unique().tolist() for r in range(5)] == [[0], [0], [1], [1], [1]]
    assert batch.response_last.tolist() == [2, 4, 7, 8, 9]
    # the second document's prompt (position 5 in the line) predicts the first token of each of its responses
    firsts = batch.target_col[torch.tensor([3, 5, 6])].tolist()
    assert firsts == [5, 5, 5]
    assert batch.max_sequence_length == 4  # [1, 2] + [4, 5]


def test_unshared_batch_has_one_line_per_response():
    exs = [Example([1, 2], [[3], [4, 5]])]
    batch = build_batch(exs, prefix_sharing=False)
    assert batch.input_ids.shape == (2, 4)
    assert batch.spans[..., 1].tolist() == [[3, 3, 3, -1], [4, 4, 4, 4]]  # a chain each, the first padded


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


def _response_facts_from_the_lines(batch, sequences) -> list[tuple[int, tuple[int, ...]]]:
    """(line, the columns of its `[prompt][response]` sequence) of every response, read off the laid-out tensors
    alone: the one column of the response's line whose ancestors-or-self (the slots whose span holds it) are exactly
    its sequence's tokens and hold every slot that predicts one of its targets."""
    facts = []
    for r in range(batch.num_responses):
        targets = (batch.target_response == r).nonzero().flatten()
        line = int(batch.target_line[targets[0]])
        predictors = set(batch.target_col[targets].tolist())
        tin, tout = batch.spans[line, :, 0], batch.spans[line, :, 1]
        found = []
        for c in (tin >= 0).nonzero().flatten().tolist():
            cols = ((tin >= 0) & (tin <= c) & (c < tout)).nonzero().flatten().tolist()
            if tuple(batch.input_ids[line, cols].tolist()) == sequences[r] and predictors <= set(cols) - {c}:
                found.append(cols)
        assert len(found) == 1, (r, found)
        facts.append((line, tuple(found[0])))
    return facts


def test_response_facts_are_those_of_the_row_layout():
    """`Batch.response_line/response_last` against a brute-force reading of the lines, in every layout: prefix-shared
    or standard rows, padded or packed, and standard rows of one example scattered over several lines (the
    benchmark's paired-packed mode); and each response's sequence (`lines.sequence_tokens`) is its prompt and its own
    tokens, nothing else. Responses of one token included (their only target is the prompt's)."""
    import random

    from conftest import random_examples
    from prefixdpo.data.batch import collate_lines
    from prefixdpo.data.lines import sequence_tokens

    examples = random_examples(shapes=((3, (1, 4)), (5, (2, 1, 3)), (2, (6, 1))), seed=3)
    batches = {
        f"{'shared' if sharing else 'standard'} {name}": build_batch(examples, prefix_sharing=sharing, **kw)
        for sharing in (True, False)
        for name, kw in (("padded", {}), ("packed", dict(packs=[[0, 2], [1]], length=32)))
    }
    units = [(e, row) for e, ex in enumerate(examples) for row in separate_rows(ex)]
    random.Random(0).shuffle(units)
    batches["standard scattered"] = collate_lines(examples, [units[:3], units[3:4], units[4:]])
    sequences = [ex.prompt_ids + r for ex in examples for r in ex.response_ids]
    for name, batch in batches.items():
        facts = _response_facts_from_the_lines(batch, sequences)
        assert batch.response_line.tolist() == [line for line, _ in facts], name
        assert batch.response_last.tolist() == [cols[-1] for _, cols in facts], name
        own = sequence_tokens(batch)
        for r, (line, cols) in enumerate(facts):
            assert own[r].nonzero().flatten().tolist() == list(cols), (name, r)


def test_response_facts_of_an_empty_batch_are_empty():
    from prefixdpo.data.loader import empty_batch

    batch = empty_batch()
    assert batch.response_line.shape == batch.response_last.shape == (0,)
