"""Synthetic length profiles: the paper's medians, medians on target, determinism, valid Examples."""

import numpy as np
import pytest

from prefixdpo.data.example import Example
from prefixdpo.data.synthetic import NUM_SPECIAL_IDS, PROFILES, synthetic_examples, synthetic_lengths

# (name, median total, median prompt/completion ratio): the paper's dataset table.
PAPER_LENGTHS = [
    ("capybara", 1160, 1.59),
    ("hh-rlhf", 186, 2.15),
    ("metamath", 872, 3.91),
    ("tldr", 416, 11.14),
    ("tulu-helpsteer", 775, 6.34),
    ("ultrafeedback", 409, 0.42),
]


def test_profiles_hold_the_paper_lengths():
    assert sorted(PROFILES) == sorted(name for name, *_ in PAPER_LENGTHS)
    for name, total, ratio in PAPER_LENGTHS:
        prof = PROFILES[name]
        assert prof.median_total == total and prof.prompt_completion_ratio == ratio
        assert prof.median_prompt + prof.median_completion == pytest.approx(total)
        assert prof.median_prompt / prof.median_completion == pytest.approx(ratio)
    hh = PROFILES["hh-rlhf"]
    assert round(hh.median_prompt) == 127 and round(hh.median_completion) == 59


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_medians_within_ten_percent(name):
    prof = PROFILES[name]
    prompt, resp = synthetic_lengths(prof, 4000, seed=1)
    assert np.median(prompt) == pytest.approx(prof.median_prompt, rel=0.1)
    assert np.median(resp) == pytest.approx(prof.median_completion, rel=0.1)
    assert np.median(prompt + resp[:, 0]) == pytest.approx(prof.median_total, rel=0.1)


def test_examples_deterministic_valid_and_consistent_with_lengths():
    a = synthetic_examples("hh-rlhf", 50, vocab_size=300, seed=5)
    assert a == synthetic_examples("hh-rlhf", 50, vocab_size=300, seed=5)
    assert a != synthetic_examples("hh-rlhf", 50, vocab_size=300, seed=6)
    prompt, resp = synthetic_lengths("hh-rlhf", 50, seed=5)
    for ex, p, r in zip(a, prompt, resp):
        assert isinstance(ex, Example) and ex.pairs == ((0, 1),)
        assert len(ex.prompt_ids) == p and [len(x) for x in ex.response_ids] == r.tolist()
        ids = ex.prompt_ids + sum(ex.response_ids, ())
        assert min(ids) >= NUM_SPECIAL_IDS and max(ids) < 300
    # Chosen and rejected lengths are drawn independently: they differ in most records.
    assert sum(len(ex.response_ids[0]) != len(ex.response_ids[1]) for ex in a) > 40


def test_many_responses_best_vs_worst():
    exs = synthetic_examples("ultrafeedback", 10, vocab_size=100, num_responses=4)
    assert all(ex.num_responses == 4 and ex.pairs == ((0, 3),) for ex in exs)
    # Prompts do not depend on K.
    two = synthetic_examples("ultrafeedback", 10, vocab_size=100, num_responses=2)
    assert [len(e.prompt_ids) for e in exs] == [len(e.prompt_ids) for e in two]


def test_max_length_caps_the_shared_row():
    exs = synthetic_examples("capybara", 200, vocab_size=1000, max_length=1024, num_responses=3)
    assert max(ex.shared_length for ex in exs) <= 1024
    assert sum(ex.shared_length >= 1000 for ex in exs) > 10  # some were capped (scaled down to ~the cap)
    prompt, resp = synthetic_lengths("hh-rlhf", 100, max_length=3)
    assert (prompt == 1).all() and (resp == 1).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown length profile 'nope'"):
        synthetic_lengths("nope", 3)
    with pytest.raises(ValueError, match="vocab_size"):
        synthetic_examples("tldr", 3, vocab_size=NUM_SPECIAL_IDS)
    with pytest.raises(ValueError, match="max_length"):
        synthetic_lengths("tldr", 3, max_length=2)
    with pytest.raises(ValueError, match="num_responses"):
        synthetic_lengths("tldr", 3, num_responses=1)


def test_multi_response_profile_is_best_vs_each_with_ultrafeedback_lengths():
    from prefixdpo.data.synthetic import BENCH_PROFILES, MULTI_RESPONSE_PROFILES, synthetic_pairs

    prof = MULTI_RESPONSE_PROFILES["ultrafeedback-k4"]
    assert list(BENCH_PROFILES) == list(PROFILES) + ["ultrafeedback-k4"]
    assert (prof.median_total, prof.prompt_completion_ratio) == (PROFILES["ultrafeedback"].median_total,
                                                                 PROFILES["ultrafeedback"].prompt_completion_ratio)
    exs = synthetic_examples("ultrafeedback-k4", 50, vocab_size=100, seed=3)
    assert all(ex.num_responses == 4 and ex.pairs == ((0, 1), (0, 2), (0, 3)) for ex in exs)
    # Prompts are UltraFeedback's for the same seed (drawn before the responses).
    two = synthetic_examples("ultrafeedback", 50, vocab_size=100, seed=3)
    assert [len(e.prompt_ids) for e in exs] == [len(e.prompt_ids) for e in two]
    # The profile's K and policy can be overridden; an unknown policy is named.
    assert synthetic_examples("ultrafeedback-k4", 2, vocab_size=100, num_responses=3, pairs_policy="best_vs_worst")[0].pairs == ((0, 2),)
    assert synthetic_pairs(3, "best_vs_each") == ((0, 1), (0, 2))
    with pytest.raises(ValueError, match="unknown pairs policy 'all'"):
        synthetic_examples("ultrafeedback-k4", 2, vocab_size=100, pairs_policy="all")
