"""The clock a benchmark times its steps with.

wall: `time.perf_counter`, what a user waits for; on a machine shared with other jobs it also counts the time the
      OS gives them, which moves one mode's steps and not another's (seen on 2 cores: a speedup's min-max spread of
      1.5-4.1 within one run while other jobs ran).
cpu:  `time.process_time`, the CPU seconds of this process's threads: the work the step itself did, whoever else
      runs. With one thread on a quiet machine it equals wall time; with several threads it also counts their
      spin-waiting, so use it with `--threads 1`. CPU devices only (a CUDA step's work is not this process's CPU
      time).
"""

from __future__ import annotations

import time
from typing import Callable

from prefixdpo.errors import ConfigError

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def step_clock(name: str, device: str) -> Callable[[], float]:
    """The clock `name` ("wall" or "cpu") for steps on `device`; a one-line ConfigError for an unknown name or CPU
    time of a CUDA step."""
    if name not in CLOCKS:
        raise ConfigError(f"unknown clock {name!r}; choose one of {', '.join(CLOCKS)}")
    if name == "cpu" and not str(device).startswith("cpu"):
        raise ConfigError(f"--clock cpu times CPU steps only; this bench runs on {device}: use --clock wall")
    return CLOCKS[name]
