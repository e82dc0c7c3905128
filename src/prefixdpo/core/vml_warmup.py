"""Settle MKL's vector-math kernel choice once, on one thread, before any multi-threaded use.

ATen computes contiguous float32/float64 `cos`, `sin`, `exp`, `log`, ... with MKL VML (vmsCos, vmdExp, ...):
once a tensor has 2048 elements or more, each intra-op thread calls VML on its own chunk. oneMKL 2024.2, the
MKL inside the torch 2.13 wheels, picks a VML function's kernel lazily on that function's first call; when the
first call runs on several threads at once, one thread can run the low-accuracy (EP) kernel on its whole chunk,
~1e3 ulp off, while identical later calls are exact (pytorch/pytorch#188792, seen on Intel AVX-512; oneMKL
2025 does not do it). A fresh process's first forward is such a first call: the RoPE cos/sin of the bench
equal-work test's first batch ([6, 56, 8] = 2688 elements) ran as two concurrent first calls, and EP-sized
errors on one of the two chunks move that batch's losses by 1e-6..5e-5 (the intermittent 1.8e-5 of issue 8).
One call on a single element runs on the calling thread only and settles the kernel for the whole process.
"""

from __future__ import annotations

import torch

# ATen's VML-backed unary ops (aten/src/ATen/cpu/vml.h, the list varies by torch version) and their
# neighbours: one call on one element costs about a microsecond, so the list errs on the long side.
VML_OPS = ("acos", "asin", "atan", "cos", "sin", "tan", "tanh", "erf", "erfc", "erfinv", "exp", "expm1",
           "log", "log10", "log1p", "log2", "sqrt", "rsqrt", "trunc")

_done = False


def warm_up() -> None:
    """Call each op of `VML_OPS` once on a one-element float32 and float64 CPU tensor (once per process)."""
    global _done
    if _done:
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)  # in every op's domain
        for name in VML_OPS:
            getattr(torch, name)(x)
    _done = True
