"""How much of the device a step uses: each mode's useful FLOP/s beside this device's own matmul rate.

The roofline is measured, not looked up: one n x n x n matmul in the policy's dtype (fp32 on CPU, with the run's
threads), timed by the steps' own clock after every counted pass. A mode's share is a per-pass ratio, its useful
FLOP/s in that pass over the matmul rate read right after it (both saw the same moment of the machine), reported
as median (min-max) over the passes; the rates drift by 10-20% on a shared 2-core machine, the ratio much less.

Useful FLOPs of a mode are the FLOP model's count of what its own layout must compute on the real tokens
(`flops.step_flop_totals`: standard sequences for the paired modes, one prefix-shared row per record for the
shared ones, a row per prompt for grouped-packed, the token trie for trie-packed), times the step's forward
passes: a DPO step is the policy's forward and backward (3) and the reference's forward (1); a reward step the
model's forward and backward (3), no LM head. Padding, recomputation and masked attention pairs are not useful,
so a share below 1 is what the layout and the kernels leave on the table, and it cannot pass 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from prefixdpo_tools.bench.spread import Spread

__all__ = ["RooflineProbe", "Roofline", "matmul_gflops", "MODE_LAYOUT"]

# each bench mode's layout in `flops.step_flop_totals`
MODE_LAYOUT = {"paired": "standard", "paired-packed": "standard", "shared": "per_record",
               "shared-packed": "per_record", "grouped-packed": "grouped", "trie-packed": "trie"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(device: torch.device, dtype: torch.dtype, n: int, clock: Callable[[], float],
                  reps: int = 3) -> float:
    """GFLOP/s of `reps` products of two n x n matrices of `dtype` on `device`, after one untimed product."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    _sync(device)
    t0 = clock()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / max(clock() - t0, 1e-9) / 1e9


@dataclass(frozen=True)
class RooflineProbe:
    """What `runner.run_workload` measures the roofline with: the matmul's size and dtype, the step's forward
    passes (DPO 4, reward 3) and which FLOPs count (`flops.step_ideals`' `keep`: a reward model drops the head)."""

    dtype: torch.dtype
    n: int = 2048
    forwards_per_step: int = 4
    keep: Callable | None = None

    def rate(self, device: torch.device, clock: Callable[[], float]) -> float:
        return matmul_gflops(device, self.dtype, self.n, clock)


@dataclass
class Roofline:
    """matmul: what was timed ("2048^3 float32, 2 threads"); matmul_gflops: its rate per counted pass;
    useful_gflop: each mode's useful GFLOP per pass (module doc); useful_gflops / share: per mode, its useful
    GFLOP/s and that over the matmul rate of the same pass."""

    matmul: str
    matmul_gflops: Spread
    useful_gflop: dict[str, float]
    useful_gflops: dict[str, Spread] = field(default_factory=dict)
    share: dict[str, Spread] = field(default_factory=dict)

    @classmethod
    def of(cls, probe: RooflineProbe, device: torch.device, rates: list[float], seconds: dict[str, list[float]],
           layout_flops: dict[str, int]) -> Roofline:
        """From the matmul rate after each counted pass [passes], each mode's seconds per pass [passes] and the
        layouts' forward FLOPs per pass (`flops.step_flop_totals`)."""
        threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
        useful = {m: probe.forwards_per_step * layout_flops[MODE_LAYOUT[m]] / 1e9 for m in seconds}
        per_s = {m: [useful[m] / s for s in seconds[m]] for m in seconds}
        return cls(matmul=f"{probe.n}^3 {str(probe.dtype).removeprefix('torch.')}{threads}",
                   matmul_gflops=Spread.of(rates), useful_gflop=useful,
                   useful_gflops={m: Spread.of(v) for m, v in per_s.items()},
                   share={m: Spread.of([u / r for u, r in zip(v, rates)]) for m, v in per_s.items()})
