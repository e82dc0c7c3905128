"""The paper's measured throughputs (`bench.paper`) and the per-profile report beside them."""

import pytest

from prefixdpo_tools.bench.paper import PAPER, format_profile_report, profile_report
from prefixdpo.data.synthetic import PROFILES

# (name, paper speedup unpacked, packed): the paper's tables as it prints them (prefix sharing over FA3).
PAPER_SPEEDUPS = [
    ("capybara", 1.42, 1.34),
    ("hh-rlhf", 1.07, 1.41),
    ("metamath", 1.38, 1.57),
    ("tldr", 1.12, 1.35),
    ("tulu-helpsteer", 1.47, 1.48),
    ("ultrafeedback", 1.11, 1.17),
]


def test_paper_numbers_cover_every_profile_and_give_its_speedups():
    assert sorted(PAPER) == sorted(PROFILES) == sorted(name for name, *_ in PAPER_SPEEDUPS)
    for name, up, pk in PAPER_SPEEDUPS:
        # The paper rounds its speedups to 2 digits (TLDR's 35.36/31.43 = 1.125 is printed as 1.12).
        assert PAPER[name].unpacked.speedup == pytest.approx(up, abs=0.006)
        assert PAPER[name].packed.speedup == pytest.approx(pk, abs=0.006)
    assert PAPER["hh-rlhf"].packed == (109.77, 104.99, 155.04)


def test_profile_report_all_profiles():
    rows = profile_report(n=2000)
    print("\n" + format_profile_report(rows))
    assert [r["profile"] for r in rows] == list(PROFILES)
    for r in rows:
        assert r["pack_length"] % 128 == 0 and r["pack_length"] >= r["quantile_length"]
        assert r["efficiency"] >= 0.9, r
        assert 0.0 < r["tokens_saved"] < 0.5  # K=2: the prompt is at most half of the unshared tokens
        assert r["paper_speedup_packed"] == PAPER[r["profile"]].packed.speedup
