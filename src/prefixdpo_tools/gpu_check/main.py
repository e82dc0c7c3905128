"""`make gpu-check`: the GPU route proved in one command, on one CUDA device, in under 8 minutes.

    PYTHONPATH=src python3 -m prefixdpo_tools.gpu_check [--out DIR] [--budget-s S]
        [--sections verify,train,sp,reuse,hybrid,bench,grpo]

Seven sections, each a list of checks; a table on stdout, and gpu-check.json + gpu-check.md in DIR
($OUT when set, else gpu-check-results):

- verify (`gpu_check.dpo`, as train and bench): tiny Llama, Qwen2, Qwen3, Mistral and Gemma-2 (soft-capping:
  flex only) in fp32 and bf16, for every GPU attention backend this install has (flex, varlen where
  `attention.backends.BACKENDS` lists it, sdpa): per-response log-probs and DPO-loss gradients against stock
  separate passes (`prefixdpo.core.verify.compare`, the cases and tolerances of `prefixdpo verify`).
- train: 5 SGD steps in fp32, standard pairs vs prefix-shared packed rows, from the same weights: per-step
  losses and final weights must agree (SGD, not AdamW: Adam's normalisation turns rounding in a
  near-zero gradient into a full-size step, which would hide the comparison). Then QLoRA as
  `prefixdpo train --use_peft --load_in_4bit` runs it (`qlora_check`), where bitsandbytes, peft and TRL are
  installed (skipped with one line naming what is missing).
- sp (`gpu_check.sequence_parallel`): sequence parallelism's attention over head shards of the whole line equals the
  attention over all heads, per backend, on one device; with 2 CUDA devices, 2 NCCL ranks holding one 4,096-token
  row between them against one process (sums, activations and max allocated memory per rank); n/a on one device.
- reuse (`gpu_check.prefix_reuse`): prefix reuse on tiny Llama and Qwen2, per backend: two long lines' policy pass
  and backward as one row each and with prefix reuse (3-5 chunks a line), sums and gradients within `verify`'s
  tolerances of the dtype; flex's and varlen's masks over external keys run nowhere else.
- hybrid (`gpu_check.hybrid`): recurrent layers on shared prefixes: tiny Qwen3.5, LFM2, NemotronH, Falcon-H1, Kimi
  Linear and gpt-oss, fp32 and bf16, per backend, verify's cases on records whose spans cross the layers' chunk
  sizes, through the CUDA kernels (`fla`, `causal-conv1d`, `mamba_ssm`) where installed (named in its first line).
- bench: `prefixdpo_tools.bench` on a compute-bound Llama shape (hidden 2048, 8 layers, bf16, rows up to 4096
  tokens): the paper's six profiles and the multi-response one, four modes, per backend; pairs/s,
  achieved/ideal, peak memory, and graphs compiled by dynamo (`counters["stats"]["unique_graphs"]`).
  Bench runs stop at the time budget (the rest are listed as skipped); they never fail the run.
- grpo (`gpu_check.grpo`, only where TRL and `datasets` are installed; else one line and one skipped
  check): `verify --task grpo` on tiny Llama and Qwen2, fp32 and bf16, per backend, against TRL's own GRPO pass
  ("grpo verify", fails the run like verify); `bench --task grpo`'s CUDA mode on the bench model until the end of
  the budget, and the whole step on the first profile ("grpo bench", never fails the run). The GRPO bench gets the last
  `--grpo-budget-s` seconds of the budget.

Exit status: 1 if a verify, train, sequence parallel, prefix reuse, hybrid or grpo verify check fails or raises, else 0. Without CUDA: one line, exit 0.
Imports only torch, transformers and prefixdpo's own modules at module level (no `datasets`, no TRL: the GPU
machine may have neither; the grpo section imports TRL only after finding it; the QLoRA step imports TRL, peft
and bitsandbytes only where all three are installed).
"""


from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time

try:
    import torch
except ImportError:  # `make gpu-check` on a python without torch: main() says so in one line
    torch = None

from prefixdpo_tools.bench.flops import ModelShape
from prefixdpo_tools.gpu_check.dpo import (
    ARCHS, BENCH_MAX_LENGTH, BENCH_SHAPE, DTYPES, QLORA_CHECK, bench_profiles, bench_section, qlora_check,
    train_check, verify_check,
)
from prefixdpo_tools.gpu_check import hybrid, prefix_reuse, sequence_parallel
from prefixdpo_tools.gpu_check.results import CheckResult, format_table, guarded, verdict, write_reports, exit_status

__all__ = ["SECTIONS", "GRPO_ARCHS", "GRPO_PROFILES", "attention_backends", "planned_checks", "grpo_missing",
           "grpo_section", "main"]

SECTIONS = ("verify", "train", "sp", "reuse", "hybrid", "bench", "grpo")  # what --sections chooses from
# gpu_check.grpo's and bench.grpo's names, spelled out here: importing them imports TRL (tested equal)
GRPO_ARCHS = ("llama", "qwen2")
GRPO_PROFILES = ("math-like", "long-context", "math-like-g16")


def attention_backends() -> list[str]:
    """The GPU backends to check, in order: flex, varlen (only where this install has it), sdpa."""
    from prefixdpo.core.attention.backends import BACKENDS

    return [b for b in ("flex", "varlen", "sdpa") if b in BACKENDS]


def planned_checks(backends: list[str] | None = None, sections=SECTIONS) -> list[tuple[str, str]]:
    """(section, name) of every check a run would make, in run order."""
    backends = attention_backends() if backends is None else backends
    plan: list[tuple[str, str]] = []
    if "verify" in sections:
        plan += [("verify", f"{arch} {dtype} {b}") for arch in ARCHS for dtype in DTYPES for b in backends]
    if "train" in sections:
        plan += [("train", f"llama float32 {b}") for b in backends] + [("train", QLORA_CHECK)]
    if "sp" in sections:
        plan += sequence_parallel.planned(backends)
    if "reuse" in sections:
        plan += prefix_reuse.planned(backends)
    if "hybrid" in sections:
        plan += hybrid.planned(backends)
    if "bench" in sections:
        plan += [("bench", f"{p} {b}") for p in bench_profiles() for b in backends]
    if "grpo" in sections:
        plan += [("grpo verify", f"{arch} {dtype} {b}") for arch in GRPO_ARCHS for dtype in DTYPES for b in backends]
        plan += [("grpo bench", f"{p} {b}") for p in GRPO_PROFILES for b in backends]
        plan += [("grpo bench", f"whole step {GRPO_PROFILES[0]}")]
    return plan


def grpo_missing() -> list[str]:
    """The packages the GRPO section needs that this python lacks (TRL, and the `datasets` it is built on)."""
    return [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]


def grpo_section(backends: list[str], device: str, deadline: float, *, bench: bool = True,
                 shape: ModelShape | None = None, length_scale: float = 1.0, rollouts: int = 2, repeats: int = 2,
                 warmup: int = 1, log=print) -> list[CheckResult]:
    """The GRPO checks (see the module doc): skipped with one line where TRL is missing; `bench=False` runs the
    exactness checks only. shape / length_scale / rollouts / repeats / warmup: the GRPO bench's workload."""
    missing = grpo_missing()
    if missing:
        line = (f"grpo: skipped: {' and '.join(missing)} not installed for this python (the GRPO checks compare "
                "against TRL's GRPOTrainer)")
        log(line)
        return [CheckResult("grpo verify", "all", "skipped", line.split(": ", 2)[2])]
    from prefixdpo.core.verify import DTYPE_TOLERANCES
    from prefixdpo_tools.gpu_check import grpo

    results = []
    for arch in GRPO_ARCHS:
        for dtype in DTYPES:
            for b in backends:
                results.append(guarded("grpo verify", f"{arch} {dtype} {b}", grpo.verify_check, arch, dtype, b, device,
                                       DTYPE_TOLERANCES[dtype]))
                log(f"  grpo verify {results[-1].name}: {results[-1].status} {results[-1].detail}")
    if bench:
        try:
            results += grpo.bench_section(backends, device, deadline, shape=shape or BENCH_SHAPE,
                                          length_scale=length_scale, rollouts=rollouts, repeats=repeats,
                                          warmup=warmup, log=log)
        except Exception as err:  # noqa: BLE001  (model or trainer build failed: keep the exactness results)
            results.append(CheckResult("grpo bench", "setup", "error", f"{type(err).__name__}: {err}"[:300]))
    return results


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options, and the sections they choose (an unknown one is a usage error, exit 2)."""
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-results",
                   help="directory for gpu-check.json and gpu-check.md (default $OUT, else gpu-check-results)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="seconds after which remaining bench runs are skipped (default 450)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--bench-examples", type=int, default=16, help="examples per bench profile (default 16)")
    p.add_argument("--bench-per-step", type=int, default=8, help="examples per optimizer step (default 8)")
    p.add_argument("--bench-repeats", type=int, default=2, help="counted passes (default 2)")
    p.add_argument("--grpo-budget-s", type=float, default=120.0,
                   help="the last seconds of --budget-s kept for the GRPO bench (default 120)")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        p.error(f"--sections: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return args, sections


def run_meta(args, backends: list[str]) -> dict:
    """The facts of the run the reports open with: device and versions, backends, the bench model."""
    import transformers

    return {
        "device": f"{torch.cuda.get_device_name()} (python {platform.python_version()}, torch {torch.__version__}, "
                  f"transformers {transformers.__version__})",
        "backends": ", ".join(backends),
        "bench model": (f"random Llama-shaped: hidden {BENCH_SHAPE.hidden}, intermediate {BENCH_SHAPE.intermediate}, "
                        f"{BENCH_SHAPE.layers} layers, {BENCH_SHAPE.heads}/{BENCH_SHAPE.kv_heads} heads, head_dim "
                        f"{BENCH_SHAPE.head_dim}, vocab {BENCH_SHAPE.vocab}, bf16; rows <= {BENCH_MAX_LENGTH} tokens; "
                        f"{args.bench_examples} examples, {args.bench_per_step} per step, 1 warm-up + "
                        f"{args.bench_repeats} counted passes"),
    }


def log(line: str) -> None:
    print(line, flush=True)


def exactness_sections(sections: list[str], backends: list[str], device: str) -> list[CheckResult]:
    """verify, then train (each backend, then QLoRA), each check's line printed as it ends."""
    results: list[CheckResult] = []
    if "verify" in sections:
        for arch in ARCHS:
            for dtype in DTYPES:
                for b in backends:
                    results.append(guarded("verify", f"{arch} {dtype} {b}", verify_check, arch, dtype, b, device))
                    log(f"  verify {results[-1].name}: {results[-1].status} {results[-1].detail}")
    if "train" in sections:
        for b in backends:
            results.append(guarded("train", f"llama float32 {b}", train_check, b, device))
            log(f"  train {results[-1].name}: {results[-1].status} {results[-1].detail}")
        results.append(guarded("train", QLORA_CHECK, qlora_check, device))
        log(f"  train {results[-1].name}: {results[-1].status} {results[-1].detail}")
    if "sp" in sections:
        results += sequence_parallel.section(backends, device, log=log)
    if "reuse" in sections:
        results += prefix_reuse.section(backends, device, log=log)
    if "hybrid" in sections:
        results += hybrid.section(backends, device, log=log)
    return results


def bench_sections(args, sections: list[str], backends: list[str], device: str, start: float) -> list[CheckResult]:
    """The DPO bench until the budget less the GRPO bench's share, then the GRPO section until the budget."""
    results: list[CheckResult] = []
    grpo_budget = args.grpo_budget_s if "grpo" in sections else 0.0
    if "bench" in sections:
        try:
            results += bench_section(backends, device, start + args.budget_s - grpo_budget,
                                     examples=args.bench_examples, per_step=args.bench_per_step,
                                     repeats=args.bench_repeats, warmup=1, log=log)
        except Exception as err:  # noqa: BLE001  (model build failed: report it, keep the exactness results)
            results.append(CheckResult("bench", "setup", "error", f"{type(err).__name__}: {err}"[:300]))
    if "grpo" in sections:
        results += grpo_section(backends, device, start + args.budget_s, rollouts=2, repeats=args.bench_repeats,
                                warmup=1, log=log)
    return results


def main(argv: list[str] | None = None) -> int:
    args, sections = parse_args(argv)
    if torch is None:
        print("gpu-check: torch is not installed for this python: nothing checked")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device (torch {torch.__version__}): nothing checked; run it on a GPU machine")
        return 0
    start = time.monotonic()
    device = "cuda"
    backends = attention_backends()
    meta = run_meta(args, backends)
    print(f"gpu-check: {meta['device']}; backends {meta['backends']}; {len(planned_checks(backends, sections))} checks")
    results = exactness_sections(sections, backends, device)
    results += bench_sections(args, sections, backends, device, start)
    meta["wall"] = f"{time.monotonic() - start:.0f} s"
    print()
    print(format_table(results))
    print(f"verdict: {verdict(results)}")
    paths = write_reports(results, meta, args.out)
    print("wrote " + ", ".join(str(x) for x in paths))
    return exit_status(results)

