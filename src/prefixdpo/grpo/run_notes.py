"""What a group trainer tells about its prefix sharing: the tokens it saved (summed over ranks at each log, one
reduction for every count) and each reason a call ran TRL's own way, said once (`SaidOnce`, the run component's:
`training.sharing_run`).

One of each per trainer, held by its run component (`training.sharing_run.SharingRun`: `counts`, `said_once`), used
by its passes (`passes.GroupPasses`), its generation and its reward-model scoring (`rollout.py`), and drained by its
one `log` (`SharingRun.drain`).
"""

from __future__ import annotations

import torch

from prefixdpo.grpo.generation import PrefillCount
from prefixdpo.training.sharing_run import SaidOnce

__all__ = ["SaidOnce", "SharingCounts"]

MODES = ("train", "eval")


class SharingCounts:
    """Per mode (train / eval), since the last log: the real tokens the shared log-prob lines ran, the real tokens
    TRL's rows hold, the lines' slots, and the prompt tokens prefilled (`generation.PrefillCount`)."""

    def __init__(self):
        self.passes = {mode: torch.zeros(3, dtype=torch.float64) for mode in MODES}
        self.prefill = {mode: PrefillCount() for mode in MODES}

    def count_lines(self, mode: str, lines) -> None:
        """Add one pass's lines (`layout.GroupLines`)."""
        self.passes[mode] += torch.tensor([lines.num_real_tokens, lines.trl_tokens, lines.num_slots],
                                          dtype=torch.float64)

    def drain(self, mode: str, accelerator, *, passes: bool, prefill: bool) -> dict[str, float]:
        """The metrics of `mode` since the last log, summed over ranks (one reduction: every rank logs at the same
        steps, as TRL's own metrics gather there), and the counts reset. passes / prefill: which metrics are on.
        -> {metric name: value}: prefix_sharing/tokens_saved and packing/efficiency (the real tokens TRL's rows hold
        vs those the shared lines ran, and vs their slots), prefix_sharing/prefill_tokens_saved (the prompt tokens
        TRL's generate prefills vs those the shared prefill ran)."""
        count = self.prefill[mode]
        local = torch.cat([self.passes[mode], torch.tensor([count.trl_tokens, count.ran_tokens], dtype=torch.float64)])
        self.passes[mode].zero_()
        count.trl_tokens = count.ran_tokens = 0
        if not (passes or prefill):
            return {}
        ours, trl, slots, prefill_trl, prefill_ran = accelerator.reduce(
            local.to(accelerator.device), reduction="sum").tolist()
        metrics = {}
        if passes and trl > 0:
            metrics["prefix_sharing/tokens_saved"] = 1.0 - ours / trl
            metrics["packing/efficiency"] = ours / slots
        if prefill and prefill_trl > 0:
            metrics["prefix_sharing/prefill_tokens_saved"] = 1.0 - prefill_ran / prefill_trl
        return metrics
