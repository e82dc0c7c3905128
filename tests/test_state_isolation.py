"""A fresh process's first forward computes what every later forward computes.

The intermittent 1.8e-5 of the old bench equal-work test (issue 8, item 5; about one fresh pytest process
in fifty, always the first group, the same value each time, gone when the same batches were recomputed in
the same process) has this cause, a first-call state of the process. ATen computes contiguous
float32/float64 `cos`, `sin`, `exp`, `log`, ... with MKL VML, each intra-op thread on its own chunk once a
tensor has >= 2048 elements. oneMKL 2024.2 (inside the torch 2.13 wheels) picks a VML function's kernel
lazily on its first call; when that first call runs on several threads at once, one thread can run the
low-accuracy (EP) kernel on its whole chunk, ~1e3 ulp off (pytorch/pytorch#188792, Intel AVX-512). The old
test's very first forward computed RoPE cos/sin on [6, 56, 8] = 2688 fp32 elements: two chunks on two
threads, both first calls. Errors of EP size (12-14 correct mantissa bits) on one chunk of that forward
move its per-pair losses by 1e-6..5e-5 (measured).

The race needs an Intel CPU and luck (on AMD, MKL's EP and HA kernels return the same bits, so it is
invisible there), so it cannot be a test; its precondition can. With the profiler on from interpreter
start, a fresh process imports prefixdpo, builds tiny Llamas and runs the bench's first batch (fp32 and
fp64); the first call of every VML-backed op, per dtype, must be small enough (< 2048 elements) to run on
the calling thread alone, while later calls are large enough to be split (so the check compares
something).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
GRAIN = 2048  # ATen's grain size for VML-backed unary kernels: smaller tensors run on the calling thread only

SCRIPT = r"""
import json, math, sys
import torch
from torch.profiler import ProfilerActivity, profile

OPS = {"acos", "asin", "atan", "cos", "sin", "tan", "tanh", "erf", "erfc", "erfinv", "exp", "expm1", "log",
       "log10", "log1p", "log2", "sqrt", "trunc"}
sys.path.insert(0, sys.argv[1])  # tests/, for conftest.tiny_model
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    from conftest import tiny_model  # sets 2 intra-op threads, as the suite runs
    from prefixdpo_tools.bench.modes import layout_group
    from prefixdpo_tools.bench.workloads import synthetic_workload
    from prefixdpo.core.attention.pass_plan import plan_pass
    from prefixdpo.core.forward import compute_response_logps
    from prefixdpo.core.model_checks import prepare_model

    workload = synthetic_workload("tulu-helpsteer", 6, 3, vocab_size=96, seed=1, length_scale=0.05)
    batch = layout_group([workload.examples[i] for i in workload.groups[0]], "paired", pack_length=None)
    for dtype in (torch.float32, torch.float64):
        model = tiny_model("llama").to(dtype)
        prepare_model(model, "sdpa")
        with torch.no_grad():
            compute_response_logps(model, batch, plan_pass(batch, "sdpa"))
calls = {}  # "op/dtype" -> input sizes in call order
for event in sorted(prof.events(), key=lambda e: e.time_range.start):
    name = event.name.removeprefix("aten::").rstrip("_")
    if name in OPS and event.input_shapes and event.input_shapes[0] and event.input_dtypes[0]:
        calls.setdefault(f"{name}/{event.input_dtypes[0]}", []).append(math.prod(event.input_shapes[0]))
print(json.dumps({"threads": torch.get_num_threads(), "calls": calls}))
"""


def test_first_call_of_every_vml_op_runs_on_one_thread():
    # a fresh interpreter with the suite's plain 2 threads (under pytest-xdist conftest would set 1)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(TESTS)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    calls = result["calls"]
    assert result["threads"] == 2
    # the forward really runs split calls: RoPE cos/sin in fp32, the log-softmax's exp in fp32 and fp64
    for key in ("cos/float", "sin/float", "exp/float", "exp/double"):
        assert max(calls.get(key, [0])) >= GRAIN, (key, calls.get(key))
    first_calls = {key: sizes[0] for key, sizes in calls.items()}
    split = {key: n for key, n in first_calls.items() if n >= GRAIN}
    assert not split, (
        f"first calls of MKL VML-backed ops split over threads (op/dtype: elements): {split}; "
        "prefixdpo.core.forward.through_engine must settle VML's kernels single-threaded before the first forward (prefixdpo.core.vml_warmup)"
    )
