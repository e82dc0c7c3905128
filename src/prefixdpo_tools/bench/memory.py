"""Peak memory of one training step.

- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` (tensor memory only).
- CPU (Linux): peak resident set size during the step minus the RSS before it. The kernel's
  high-water mark is reset before the step (`/proc/self/clear_refs` <- "5") and read from
  `VmHWM` after it; `malloc_trim(0)` first returns freed heap pages to the OS, so memory a previous
  mode freed but glibc kept does not hide this step's allocations. tracemalloc would be wrong here: it
  does not see torch's allocations.
- Elsewhere: `ru_maxrss` growth, which only shows a step that raises the process's all-time peak.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys

import torch

__all__ = ["PeakMemory"]


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """`with meter: step()` then `meter.peak_bytes`: extra memory the step needed at its peak.

    `method` says how it was measured (reported alongside the numbers).
    """

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.peak_bytes = 0
        if self.device.type == "cuda":
            self.method = "torch.cuda.max_memory_allocated (tensors; includes weights and optimizer state)"
        elif sys.platform.startswith("linux") and _status_kb("VmHWM") is not None and _reset_hwm():
            self.method = "peak RSS during the step minus RSS before it (Linux VmHWM reset per step)"
        else:
            self.method = "ru_maxrss growth (only steps that raise the process peak show)"

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        gc.collect()
        _malloc_trim()
        if self.method.startswith("peak RSS"):
            _reset_hwm()
            self._base_kb = _status_kb("VmRSS") or 0
        else:
            self._base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        elif self.method.startswith("peak RSS"):
            self.peak_bytes = max(0, ((_status_kb("VmHWM") or 0) - self._base_kb) * 1024)
        else:
            self.peak_bytes = max(0, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self._base_kb) * 1024)
