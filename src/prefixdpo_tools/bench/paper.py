"""The paper's measured throughputs, per length profile, and what our synthetic profiles give beside them.

Wang & Hegde, "Accelerating Direct Preference Optimization with Prefix Sharing" (arXiv 2410.20305):
samples/s on 8x H100 (Llama-3.1-8B-Instruct / Mistral-7B, bf16, ZeRO-3, gradient checkpointing) for
standard DPO with FlashAttention-3 and with FlexAttention, and for FlexAttention with prefix sharing,
without and with sequence packing. The benchmark reports these beside its own measurements; the length
profiles themselves (medians, ratios) live in `prefixdpo.data.synthetic`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from prefixdpo.data.synthetic import PROFILES, synthetic_lengths

__all__ = ["Throughput", "PaperResult", "PAPER", "profile_report", "format_profile_report"]


class Throughput(NamedTuple):
    """Samples/s the paper measured: FA3 and Flex standard DPO, Flex with prefix sharing."""

    fa3: float
    flex: float
    flex_prefix: float

    @property
    def speedup(self) -> float:
        """Prefix sharing over the faster standard baseline (FA3), as the paper reports it."""
        return self.flex_prefix / self.fa3


class PaperResult(NamedTuple):
    """The paper's throughputs on one dataset: without (`unpacked`) and with (`packed`) sequence packing."""

    unpacked: Throughput
    packed: Throughput


# Keys are the names of `prefixdpo.data.synthetic.PROFILES`.
PAPER: dict[str, PaperResult] = {
    name: PaperResult(Throughput(*unpacked), Throughput(*packed))
    for name, unpacked, packed in (
        ("capybara", (8.38, 7.75, 11.90), (17.89, 17.63, 23.89)),
        ("hh-rlhf", (33.71, 30.25, 36.11), (109.77, 104.99, 155.04)),
        ("metamath", (13.86, 13.02, 19.13), (24.21, 23.83, 38.07)),
        ("tldr", (31.43, 29.53, 35.36), (44.11, 43.22, 59.76)),
        ("tulu-helpsteer", (14.83, 13.93, 21.75), (29.85, 28.98, 44.10)),
        ("ultrafeedback", (18.40, 17.31, 20.46), (45.46, 44.13, 53.21)),
    )
}


def profile_report(
    n: int = 4000, *, seed: int = 0, num_responses: int = 2, quantile: float = 0.95, factor: float = 1.1
) -> list[dict]:
    """Per profile: tokens saved by prefix sharing and bin-packing efficiency at the auto pack length, beside
    the paper's measured speedups.

    tokens_saved    = 1 - shared / unshared tokens (prompt once vs once per response).
    pack_length     = auto_pack_length of the shared rows (never below the longest row);
    quantile_length = the paper's rule alone (factor x quantile, rounded up to 128), for comparison.
    efficiency      = real tokens / (packs x pack_length), packs from plan_packs;
    unpacked_eff    = real tokens / tokens when each row is padded alone to a multiple of 128.
    """
    from prefixdpo.data.packing import auto_pack_length, packing_efficiency, plan_packs

    rows = []
    for prof in PROFILES.values():
        prompt, resp = synthetic_lengths(prof, n, seed=seed, num_responses=num_responses)
        shared = prompt + resp.sum(axis=1)
        unshared = num_responses * prompt + resp.sum(axis=1)
        lengths = shared.tolist()
        pack_length = auto_pack_length(lengths, quantile=quantile, factor=factor)
        packs = plan_packs(lengths, pack_length, seed=seed)
        q = float(np.quantile(shared, quantile))
        rows.append(
            {
                "profile": prof.name,
                "median_prompt": float(np.median(prompt)),
                "median_completion": float(np.median(resp)),
                "median_shared_row": float(np.median(shared)),
                "tokens_saved": 1.0 - float(shared.sum()) / float(unshared.sum()),
                "quantile_length": int(math.ceil(factor * q / 128)) * 128,
                "pack_length": pack_length,
                "packs": len(packs),
                "efficiency": packing_efficiency(lengths, packs, pack_length),
                "unpacked_eff": float(shared.sum()) / float((np.ceil(shared / 128) * 128).sum()),
                "paper_speedup_unpacked": PAPER[prof.name].unpacked.speedup,
                "paper_speedup_packed": PAPER[prof.name].packed.speedup,
            }
        )
    return rows


def format_profile_report(rows: list[dict]) -> str:
    """`profile_report()` as a fixed-width text table."""
    head = (
        f"{'profile':<15} {'prompt':>6} {'compl':>6} {'saved':>6} {'q-len':>6} {'pack':>6} "
        f"{'eff':>6} {'unpk':>6} {'paper x':>12}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['profile']:<15} {r['median_prompt']:>6.0f} {r['median_completion']:>6.0f} "
            f"{r['tokens_saved']:>6.1%} {r['quantile_length']:>6d} {r['pack_length']:>6d} "
            f"{r['efficiency']:>6.1%} {r['unpacked_eff']:>6.1%} "
            f"{r['paper_speedup_unpacked']:>5.2f}/{r['paper_speedup_packed']:<5.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m prefixdpo_tools.bench.paper
    print(format_profile_report(profile_report()))
