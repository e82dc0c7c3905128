"""Run the four modes on each workload, interleaved, and collect throughput, memory and speedups.

Protocol (per workload):

1. Every mode lays out every group of examples once (`modes.layout_group`), before timing: collation
   is data loading, done by dataloader workers in a real run; its cost is reported separately.
2. `warmup + repeats` passes over the groups; in each pass, for each group, the modes run one DPO
   step each in the order A B C D. Interleaving step by step means a noisy machine's drift (other
   processes, thermal state) hits all modes alike. The warm-up passes are not counted.
3. Per counted pass and mode: pairs/s and tokens/s over the whole workload. Reported: median and
   min-max over passes. Speedups are per-pass time ratios (both modes saw the same moment of the
   machine), then median and min-max.

One policy, one reference and one AdamW are shared by all modes: the weights' values do not change
the cost of a step, and so the four modes run literally the same modules.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from prefixdpo_tools.bench.memory import PeakMemory
from prefixdpo_tools.bench.modes import GROUPED_MODE, MODES, TRIE_MODE, common_pack_length, layout_group
from prefixdpo_tools.bench.paper import PAPER
from prefixdpo_tools.bench.results import ModeRun, WorkloadRun
from prefixdpo_tools.bench.roofline import Roofline, RooflineProbe
from prefixdpo_tools.bench.spread import Spread
from prefixdpo_tools.bench.step import DPOStep
from prefixdpo_tools.bench.workloads import Workload
from prefixdpo_tools.bench.flops import ModelShape, ideal_speedup, step_flop_totals, step_ideals
from prefixdpo.data.grouping import group_by_prompt
from prefixdpo.data.tree import tree_line

__all__ = ["Spread", "ModeResult", "ProfileResult", "run_workload", "workload_modes"]

# (faster mode, baseline mode, key): the paper's two tables, and prefix sharing + packing over TRL's default.
SPEEDUPS = (
    ("shared", "paired", "shared_vs_paired"),
    ("shared-packed", "paired-packed", "shared_packed_vs_paired_packed"),
    ("shared-packed", "paired", "shared_packed_vs_paired"),
    (GROUPED_MODE, "paired-packed", "grouped_packed_vs_paired_packed"),
    (GROUPED_MODE, "shared-packed", "grouped_packed_vs_shared_packed"),
    (TRIE_MODE, "paired-packed", "trie_packed_vs_paired_packed"),
    (TRIE_MODE, "shared-packed", "trie_packed_vs_shared_packed"),
)



@dataclass
class ModeResult(ModeRun):
    """One mode on one workload: `ModeRun`'s fields, and pairs and real tokens per second of each counted pass."""

    pairs_per_s: Spread
    tokens_per_s: Spread
    collate_ms_per_step: float


@dataclass(kw_only=True)
class ProfileResult(WorkloadRun):
    """All modes on one workload (`WorkloadRun`), its sizes, the FLOP model's ideal and the paper's numbers."""

    examples: int
    pairs: int
    pack_length: int | None  # None: each step's examples in one line (`--packing step`)
    length_scale: float
    ideal: float
    flop_split: dict
    paper: dict | None = None
    ideals: dict[str, float] = field(default_factory=dict)  # `flops.step_ideals`: per_record, grouped, trie
    roofline: Roofline | None = None  # each mode's useful FLOP/s over this device's matmul rate (`roofline`)

    @property
    def achieved_over_ideal(self) -> float:
        return self.speedups["shared_packed_vs_paired_packed"].median / self.ideal

    @property
    def grouped(self) -> bool:
        """Whether the grouped mode ran (the workload's steps hold several records of one prompt)."""
        return GROUPED_MODE in self.modes

    def trie_over_ideal(self) -> dict[str, float]:
        """The trie mode's speedups over their ideals (vs paired-packed: trie; vs shared-packed: trie / per_record),
        where it ran."""
        return self._over_ideals(TRIE_MODE, "trie")

    def grouped_over_ideal(self) -> dict[str, float]:
        """The grouped mode's speedups over their ideals: vs paired-packed (ideal: grouped) and vs shared-packed
        (ideal: grouped / per_record, what grouping alone saves)."""
        return self._over_ideals(GROUPED_MODE, "grouped")

    def _over_ideals(self, mode: str, ideal: str) -> dict[str, float]:
        """`mode`'s speedups (keys `<ideal>_packed_vs_*`) over the step ideal `ideal`, vs paired-packed, and over
        what it saves beyond per-record sharing, vs shared-packed; empty where the mode did not run."""
        if mode not in self.modes:
            return {}
        alone = self.ideals[ideal] / self.ideals["per_record"]
        return {"vs_paired_packed": self.speedups[f"{ideal}_packed_vs_paired_packed"].median / self.ideals[ideal],
                "vs_shared_packed": self.speedups[f"{ideal}_packed_vs_shared_packed"].median / alone}


TRIE_MIN_SAVING = 0.1  # the trie mode runs where it saves at least this share of the grouped rows' tokens


def workload_modes(workload: Workload, modes=MODES, *, trie: bool = False) -> tuple[str, ...]:
    """`modes`, and the grouped mode where a step of the workload holds several records of one prompt; with `trie`
    (the step's backend follows tree lines), the trie mode where a token trie saves at least `TRIE_MIN_SAVING` of
    the grouped rows' tokens (real data shares a BOS token and often a word or two: not worth a fifth mode)."""
    steps = [[workload.examples[i] for i in group] for group in workload.groups]
    extra = []
    if any(len({ex.prompt_ids for ex in step}) < len(step) for step in steps):
        extra.append(GROUPED_MODE)
    grouped = sum(g.shared_length for step in steps for g in group_by_prompt(step)[0])
    if trie and sum(len(tree_line(step)) for step in steps) <= (1 - TRIE_MIN_SAVING) * grouped:
        extra.append(TRIE_MODE)
    return tuple(modes) + tuple(m for m in extra if m not in modes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _layout_batches(workload: Workload, modes, *, pack_length: int | None, pad_token_id: int, bucketed: bool,
                    line_multiple: int, device: torch.device) -> tuple[dict[str, list], dict[str, float]]:
    """Every mode's batches of every group (on `device`), and each mode's collation seconds (before the copy)."""
    batches: dict[str, list] = {}
    collate_s: dict[str, float] = {}
    for mode in modes:
        t0 = time.perf_counter()
        batches[mode] = [
            layout_group([workload.examples[i] for i in group], mode, pack_length=pack_length,
                         pad_token_id=pad_token_id, bucketed=bucketed, line_multiple=line_multiple)
            for group in workload.groups
        ]
        collate_s[mode] = time.perf_counter() - t0
        batches[mode] = [b.to(device) for b in batches[mode]]
    return batches, collate_s


@dataclass
class _Timings:
    """What `_time_steps` measured: seconds per counted pass [repeats] and peak memory bytes of each mode, how peak
    memory was measured, and the roofline probe's matmul rate after each counted pass (empty without a probe)."""

    seconds: dict[str, list[float]]
    peak: dict[str, int]
    memory_method: str
    matmul_gflops: list[float]


def _time_steps(batches: dict[str, list], stepper: DPOStep, device: torch.device, *, repeats: int, warmup: int,
                progress, clock: Callable[[], float], probe: RooflineProbe | None = None) -> _Timings:
    """Every mode's steps, the modes interleaved step by step (module docstring); with `probe`, its matmul after
    every counted pass."""
    modes = list(batches)
    groups = len(batches[modes[0]])
    seconds = {m: [0.0] * repeats for m in modes}
    peak = {m: 0 for m in modes}
    rates: list[float] = []
    meter = PeakMemory(device)
    for r in range(warmup + repeats):
        for g in range(groups):
            for mode in modes:
                with meter:
                    _sync(device)
                    t0 = clock()
                    stepper.step(batches[mode][g])
                    _sync(device)
                    dt = clock() - t0
                if r >= warmup:
                    seconds[mode][r - warmup] += dt
                    peak[mode] = max(peak[mode], meter.peak_bytes)
                if progress is not None:
                    progress.update(1)
        if probe is not None and r >= warmup:
            rates.append(probe.rate(device, clock))
    return _Timings(seconds, peak, meter.method, rates)


def _mode_result(mode: str, batches: list, seconds: list[float], peak_bytes: int, pairs: int,
                 collate_s: float) -> ModeResult:
    tokens = sum(b.num_real_tokens for b in batches)
    return ModeResult(
        mode=mode,
        pairs_per_s=Spread.of([pairs / s for s in seconds]),
        tokens_per_s=Spread.of([tokens / s for s in seconds]),
        seconds=seconds,
        peak_mb=peak_bytes / 2**20,
        tokens=tokens,
        slots=sum(b.num_slots for b in batches),
        lines=sum(int(b.input_ids.shape[0]) for b in batches),
        steps=len(batches),
        collate_ms_per_step=1e3 * collate_s / max(1, len(batches)),
    )


def _speedups(seconds: dict[str, list[float]]) -> dict[str, Spread]:
    """Each of SPEEDUPS' ratios whose two modes ran, pass by pass (base seconds over fast seconds)."""
    return {key: Spread.of([b / a for a, b in zip(seconds[fast], seconds[base])])
            for fast, base, key in SPEEDUPS if fast in seconds and base in seconds}


def _paper_numbers(workload: Workload) -> dict | None:
    """The paper's throughputs and speedups for the workload's profile (None: the paper has no such profile)."""
    if workload.profile is None or workload.profile.name not in PAPER:
        return None
    p = PAPER[workload.profile.name]
    return {
        "unpacked_samples_per_s": p.unpacked._asdict(),
        "packed_samples_per_s": p.packed._asdict(),
        "shared_vs_paired": p.unpacked.speedup,
        "shared_packed_vs_paired_packed": p.packed.speedup,
    }


def run_workload(
    workload: Workload,
    stepper: DPOStep,
    shape: ModelShape,
    *,
    device: str = "cpu",
    repeats: int = 3,
    warmup: int = 1,
    modes=MODES,
    progress=None,
    pad_token_id: int = 0,
    line_per_step: bool = False,
    trie: bool = False,
    line_multiple: int = 128,
    clock: Callable[[], float] = time.perf_counter,
    roofline: RooflineProbe | None = None,
) -> ProfileResult:
    """Benchmark `modes` on `workload` with `stepper` (see the module docstring for the protocol).

    progress: a tqdm-like object with `update(n)` (one unit per step), or None.
    line_per_step: packed modes put each step's whole group in one line (see `modes.layout_group`), padded to a
                   multiple of `line_multiple`.
    trie: the stepper's backend follows tree lines, so the trie mode may run (`workload_modes`).
    clock: what a step's seconds are read from (`bench.clock`: wall or this process's CPU time).
    roofline: measure each mode's useful FLOP/s against this device's matmul rate (`bench.roofline`); None: not.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    dev = torch.device(device)
    examples = workload.examples
    steps = [[examples[i] for i in group] for group in workload.groups]
    modes = workload_modes(workload, modes, trie=trie)
    grouped = [g for step in steps for g in group_by_prompt(step)[0]] if GROUPED_MODE in modes else []
    pack_length = None if line_per_step else common_pack_length(examples, grouped=grouped)
    batches, collate_s = _layout_batches(workload, modes, pack_length=pack_length, pad_token_id=pad_token_id,
                                         bucketed=dev.type == "cuda", line_multiple=line_multiple, device=dev)
    timings = _time_steps(batches, stepper, dev, repeats=repeats, warmup=warmup, progress=progress, clock=clock,
                          probe=roofline)
    seconds = timings.seconds
    return ProfileResult(
        name=workload.name,
        examples=len(examples),
        pairs=workload.num_pairs,
        steps=len(workload.groups),
        pack_length=pack_length,
        length_scale=workload.length_scale,
        ideal=ideal_speedup(shape, examples),
        ideals=step_ideals(shape, steps),
        flop_split={
            "standard": shape.flop_fractions(examples, shared=False),
            "shared": shape.flop_fractions(examples, shared=True),
        },
        modes={m: _mode_result(m, batches[m], seconds[m], timings.peak[m], workload.num_pairs, collate_s[m])
               for m in modes},
        speedups=_speedups(seconds),
        paper=_paper_numbers(workload),
        notes=list(workload.notes) + [f"peak memory: {timings.memory_method}"],
        roofline=None if roofline is None else Roofline.of(
            roofline, dev, timings.matmul_gflops, seconds, step_flop_totals(shape, steps, roofline.keep)),
    )
