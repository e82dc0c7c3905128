"""Truncation on the whole row, pairs policies, and the report: every loaded record is accounted for."""

from __future__ import annotations

import pytest

from prefixdpo.data.formats import preference_pairs
from prefixdpo.data.prepare import DataOptions, prepare_examples
from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
from prefixdpo.data.truncate import truncate_row


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


P10 = list(range(100, 110))


def lens(result):
    prompt, responses, status = result
    return len(prompt), [len(r) for r in responses], status


def test_truncate_row_fits_untouched():
    assert lens(truncate_row(P10, [[1] * 5, [2] * 5], max_length=20, max_prompt_length=10)) == (10, [5, 5], "kept")


def test_max_prompt_length_keep_end_cuts_the_start():
    prompt, _, status = truncate_row(P10, [[1], [2]], max_prompt_length=4)
    assert prompt == P10[-4:] and status == "truncated"
    prompt, _, _ = truncate_row(P10, [[1], [2]], max_prompt_length=4, truncation_mode="keep_start")
    assert prompt == P10[:4]


def test_row_limit_keep_end_prompt_yields_first_down_to_half():
    # Responses 5 + 5 fit beside a 20-token prompt cut from the left to 14 (>= 24 // 2): row 24.
    p20 = list(range(20))
    prompt, responses, _ = truncate_row(p20, [[1] * 5, [2] * 5], max_length=24)
    assert prompt == p20[-14:] and responses == [[1] * 5, [2] * 5]
    # Long responses: the prompt keeps max_length // 2 = 9, responses share the other 9 with a common cap of 6
    # (the short one stays whole), cut from the right.
    prompt, responses, _ = truncate_row(P10, [list(range(20)), [7, 7, 7]], max_length=18)
    assert prompt == P10[-9:] and responses == [list(range(6)), [7, 7, 7]]


def test_row_limit_keep_start_keeps_prompt_and_drops_when_prompt_fills_row():
    prompt, responses, _ = truncate_row(P10, [[1] * 8, [2] * 3], max_length=17, truncation_mode="keep_start")
    assert prompt == P10 and responses == [[1] * 4, [2] * 3]
    assert truncate_row(P10, [[1] * 8, [2] * 3], max_length=11, truncation_mode="keep_start") is None


def test_overlong_drop():
    assert truncate_row(P10, [[1] * 5, [2] * 5], max_length=19, overlong="drop") is None
    assert truncate_row(P10, [[1], [2]], max_prompt_length=9, overlong="drop") is None
    assert lens(truncate_row(P10, [[1], [2]], max_length=12, overlong="drop")) == (10, [1, 1], "kept")


def test_row_always_fits_after_truncation():
    for p in (1, 5, 40):
        for r in ((1, 1), (30, 2), (50, 50, 50)):
            for limit in (8, 16, 64):
                out = truncate_row(list(range(p)), [[1] * n for n in r], max_length=limit)
                if out is not None:
                    assert len(out[0]) + sum(map(len, out[1])) <= limit and all(out[1])


def test_prepare_counts_truncated_and_dropped(tok):
    short = {"prompt": "Q:", "chosen": " a", "rejected": " b"}
    long = {"prompt": "Question: what is the capital of France? " * 4, "chosen": " Paris is." * 6, "rejected": " Rome."}
    records = [short, long, short]
    data = prepare_examples(records, tok, DataOptions(max_length=40))
    rep = data.report
    assert (rep.loaded, rep.kept, rep.truncated, rep.dropped) == (3, 3, 1, 0)
    assert data.examples[1].shared_length <= 40 and data.examples[1].meta["truncated"]
    rep = prepare_examples(records, tok, DataOptions(max_length=40, overlong="drop")).report
    assert (rep.kept, rep.truncated, rep.dropped) == (2, 0, 1)
    assert "Dropped 1 over the length limits." in rep.summary()
    rep = prepare_examples(records, tok, DataOptions(max_length=8, truncation_mode="keep_start")).report
    assert rep.loaded == rep.kept + rep.dropped and rep.dropped >= 1


def test_preference_pairs_policies():
    scores = [1.0, 3.0, 2.0, 3.0]  # a tie for best: the first best is used
    assert preference_pairs(scores, "best_vs_worst") == [(1, 0)]
    assert preference_pairs(scores, "best_vs_each") == [(1, 0), (1, 2)]
    assert sorted(preference_pairs(scores, "all_pairs")) == [(1, 0), (1, 2), (2, 0), (3, 0), (3, 2)]
    assert preference_pairs([2.0, 2.0], "all_pairs") == []


def test_multi_response_one_example_per_prompt(tok):
    rec = {"prompt": "Q:", "completions": [" a", " b", " c", " d"], "scores": [1, 4, 2, 0]}
    data = prepare_examples([rec], tok, DataOptions(pairs_policy="best_vs_worst"))
    (ex,) = data.examples
    # Only the used responses (best = 1, worst = 3) go into the row; the two others are counted as unused.
    assert ex.num_responses == 2 and ex.pairs == ((0, 1),) and ex.meta["scores"] == (4.0, 0.0)
    assert tok.decode(ex.response_ids[0]).startswith(" b") and data.report.unused_responses == 2
    (ex,) = prepare_examples([rec], tok, DataOptions(pairs_policy="best_vs_each")).examples
    assert ex.num_responses == 4 and ex.pairs == ((1, 0), (1, 2), (1, 3))
    (ex,) = prepare_examples([rec], tok, DataOptions(pairs_policy="all_pairs")).examples
    assert len(ex.pairs) == 6 and ex.num_responses == 4


def test_summary_mentions_formats_and_boundary(tok):
    recs = [{"prompt": "Answer: ", "chosen": "Paris", "rejected": "Rome"},
            {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yo"}],
             "rejected": [{"role": "assistant", "content": "no"}]}]
    text = prepare_examples(recs, tok).report.summary()
    assert text.startswith("Loaded 2 records, kept 2 examples (1 conversational, 1 standard).")
    assert "1 prompts tokenize differently alone" in text
