"""One run's prefix sharing: `SharingRun`, the one object a trainer (DPO/reward through `base.PrefixTrainerBase`, the
GRPO/RLOO trainers through `grpo.trainer.PrefixGroupTrainer`) builds once and holds as `trainer.sharing`.

What every pass of the run needs to know besides its rows, and what the run tells about its sharing, live here, read
and written through this object only (its step, passes, generation and scoring take it explicitly), not as trainer
attributes that several mix-ins set and read:

- the pass backend (`backend`): resolved once (DPO/reward: the backend the passes run, or `STOCK`; GRPO/RLOO: the
  attention its passes resolve for their device and grad mode, `backend_for`);
- the sequence-parallel group (`sequence_parallel`, None for one rank a line) and the data-parallel rank and world
  the loaders deal to (`dp_rank`, `dp_world`);
- prefix reuse's budget (`tokens_per_pass`, None: no reuse);
- the notes said once (`said_once`: a call that ran TRL's own way, and why);
- the sharing metrics (`counts`: the method's, GRPO's `grpo.run_notes.SharingCounts`; the DPO family counts its
  tokens in its metric sums, `training.metrics.COUNTS`), drained into a log by `drain`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from prefixdpo.core import sequence_parallel as sp_module
from prefixdpo.core.attention.backends import resolve_backend
from prefixdpo.core.attention.pass_plan import STOCK
from prefixdpo.core.sequence_parallel import SequenceParallel

__all__ = ["SaidOnce", "SharingRun", "start_sharing"]

logger = logging.getLogger(__name__)


class SaidOnce:
    """Logs each (what, reason) once per run: a pass, a generate call or a reward-model call that ran TRL's own way,
    and why."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.said: set[tuple[str, str]] = set()

    def __call__(self, what: str, reason: str, consequence: str) -> None:
        if (what, reason) not in self.said:
            self.said.add((what, reason))
            self.logger.warning("%s: %s; %s (said once)", what, reason, consequence)


@dataclass(eq=False)
class SharingRun:
    """A run's prefix sharing (module docstring). Built once per trainer (`start_sharing`); `backend` alone changes
    after, where a GRPO trainer's settings change (`change_settings`: verification and benchmarks compare backends)."""

    backend: str
    tokens_per_pass: int | None = None
    sequence_parallel: SequenceParallel | None = None
    dp_rank: int = 0
    dp_world: int = 1
    said_once: SaidOnce = field(default_factory=lambda: SaidOnce(logger))
    counts: Any = None  # the method's sharing counts: `drain(mode, accelerator, **which) -> {metric: value}`

    @property
    def sp_size(self) -> int:
        """Ranks per line (1: no sequence parallelism)."""
        return 1 if self.sequence_parallel is None else self.sequence_parallel.size

    @property
    def counted(self) -> bool:
        """Whether this rank's sums count in a reduce over ranks: only the first rank of each sequence-parallel group's
        (every rank of a group sees the same lines and pairs)."""
        return self.sequence_parallel is None or self.sequence_parallel.rank == 0

    def backend_for(self, device, *, needs_grad: bool) -> str:
        """The backend a pass on `device` runs (`STOCK` as it is: the model's own attention)."""
        return self.backend if self.backend == STOCK else resolve_backend(self.backend, device, needs_grad=needs_grad)

    def attach(self, *models) -> None:
        """Every pass of `models` (the policy, a separate reference) runs over this rank's group."""
        for model in models:
            if model is not None:
                sp_module.attach(model, self.sequence_parallel)

    def note(self, what: str, reason: str, consequence: str) -> None:
        """Say once that `what` ran TRL's own way for `reason` (`SaidOnce`)."""
        self.said_once(what, reason, consequence)

    def drain(self, mode: str, accelerator, **which) -> dict[str, float]:
        """The sharing metrics of `mode` since the last log, summed over ranks, and the counts reset (a collective:
        every rank calls it at the same log); `which`: the method's switches for its metrics. {} without counts."""
        return {} if self.counts is None else self.counts.drain(mode, accelerator, **which)


def start_sharing(model, backend: str, *, sequence_parallel_size: int = 1, tokens_per_pass: int | None = None,
                  rank: int = 0, world: int = 1, said_once: SaidOnce | None = None, counts=None) -> SharingRun:
    """The `SharingRun` of a run on `model`: its sequence-parallel group (`sequence_parallel_size` checked against the
    model; None for 1) and the data-parallel rank and world (`rank` / `world`: the process's, without a group)."""
    if sequence_parallel_size > 1:
        sp_module.check_model(model, sequence_parallel_size)
    group = sp_module.new_sequence_parallel(sequence_parallel_size)
    dp_rank, dp_world = sp_module.data_parallel(sequence_parallel_size) if sequence_parallel_size > 1 else (rank, world)
    return SharingRun(backend, tokens_per_pass, group, dp_rank, dp_world,
                      said_once if said_once is not None else SaidOnce(logger), counts)
