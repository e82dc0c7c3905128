"""What a benchmark's counted passes leave, whatever the task: DPO and reward (`runner.ModeResult`,
`runner.ProfileResult`) and GRPO (`grpo.GroupModeResult`, `grpo.GroupProfileResult`) add their own to these."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from prefixdpo_tools.bench.spread import Spread


@dataclass
class ModeRun:
    """One mode's counted passes over one workload.

    seconds: [repeats] each counted pass's seconds (a pass runs every step of the workload once); peak_mb: peak
    memory of a step; tokens: real (non-padding) tokens one pass runs; slots: its lines x line length; lines: the
    lines one pass runs; steps: the optimizer steps of a pass.
    """

    mode: str
    seconds: list[float]
    peak_mb: float
    tokens: int
    slots: int
    lines: int
    steps: int

    @property
    def fill(self) -> float:
        """Real tokens / computed slots (1 - padding fraction)."""
        return self.tokens / self.slots if self.slots else 0.0

    @property
    def seconds_per_step(self) -> float:
        """Median over the counted passes of a pass's seconds, per step."""
        return statistics.median(self.seconds) / self.steps

    def derived(self) -> dict[str, float]:
        """The properties a report's JSON adds to the fields."""
        return {"fill": self.fill, "seconds_per_step": self.seconds_per_step}


@dataclass(kw_only=True)
class WorkloadRun:
    """Every mode on one workload (a DPO/reward profile or dataset, a GRPO profile): the steps of a pass, each
    mode's `ModeRun`, the speedups (per-pass time ratios, named `<fast>_vs_<baseline>`) and notes for the report."""

    name: str
    steps: int
    modes: dict[str, ModeRun]
    speedups: dict[str, Spread]
    notes: list[str] = field(default_factory=list)
