"""`make gpu-check`: the GPU route proved in one command, on one CUDA device, in under 8 minutes.

    PYTHONPATH=src python3 -m prefixdpo.gpu_check [--out DIR] [--budget-s S] [--sections verify,train,bench,grpo]

Four sections, each a list of checks; a table on stdout, and gpu-check.json + gpu-check.md in DIR
($OUT when set, else gpu-check-results):

- verify: tiny Llama, Qwen2, Qwen3, Mistral and Gemma-2 (soft-capping: flex only) in fp32 and bf16, for
  every GPU attention backend this install has (flex, varlen where `attention.backends.BACKENDS` lists
  it, sdpa): per-response log-probs and DPO-loss gradients against stock separate passes
  (`prefixdpo.core.verify.compare`, the cases and tolerances of `prefixdpo verify`).
- train: 5 SGD steps in fp32, standard pairs vs prefix-shared packed rows, from the same weights: per-step
  losses and final weights must agree (SGD, not AdamW: Adam's normalisation turns rounding in a
  near-zero gradient into a full-size step, which would hide the comparison). Then QLoRA as
  `prefixdpo train --use_peft --load_in_4bit` runs it (`qlora_check`), where bitsandbytes, peft and TRL are
  installed (skipped with one line naming what is missing).
- bench: `prefixdpo.bench` on a compute-bound Llama shape (hidden 2048, 8 layers, bf16, rows up to 4096
  tokens): the paper's six profiles and the multi-response one, four modes, per backend; pairs/s,
  achieved/ideal, peak memory, and graphs compiled by dynamo (`counters["stats"]["unique_graphs"]`).
  Bench runs stop at the time budget (the rest are listed as skipped); they never fail the run.
- grpo (`prefixdpo.gpu_check_grpo`, only where TRL and `datasets` are installed; else one line and one skipped
  check): `verify --task grpo` on tiny Llama and Qwen2, fp32 and bf16, per backend, against TRL's own GRPO pass
  ("grpo verify", fails the run like verify); `bench --task grpo`'s CUDA mode on the bench model until the end of
  the budget, and the whole step on the first profile ("grpo bench", never fails the run). The GRPO bench gets the last
  `--grpo-budget-s` seconds of the budget.

Exit status: 1 if a verify, train or grpo verify check fails or raises, else 0. Without CUDA: one line, exit 0.
Imports only torch, transformers and prefixdpo's own modules at module level (no `datasets`, no TRL: the GPU
machine may have neither; the grpo section imports TRL only after finding it; the QLoRA step imports TRL, peft
and bitsandbytes only where all three are installed).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

try:
    import torch
except ImportError:  # `make gpu-check` on a python without torch: main() says so in one line
    torch = None

from prefixdpo.atomic_io import atomic_write_text
from prefixdpo.bench.flops import ModelShape

__all__ = [
    "ARCHS", "DTYPES", "BENCH_SHAPE", "QLORA_CHECK", "CheckResult", "attention_backends", "planned_checks",
    "format_table", "markdown_report", "write_reports", "exit_status", "main",
]

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2")
DTYPES = ("float32", "bfloat16")
SECTIONS = ("verify", "train", "bench", "grpo")  # what --sections chooses from
TABLES = ("verify", "train", "bench", "grpo verify", "grpo bench")  # the results' sections, in report order
# prefixdpo.grpo.verify / .bench names, spelled out here: importing prefixdpo.grpo imports TRL (tested equal)
GRPO_ARCHS = ("llama", "qwen2")
GRPO_PROFILES = ("math-like", "long-context", "math-like-g16")
# Llama-shaped and compute-bound on one H200 in bf16 (~0.45 G body weights per token, GQA 4:1,
# head_dim 128 as Llama-3), small enough that the seven profiles x four modes fit the time budget.
BENCH_SHAPE = ModelShape(hidden=2048, intermediate=7168, layers=8, heads=16, kv_heads=4, head_dim=128, vocab=32000)
BENCH_MAX_LENGTH = 4096
TRAIN_STEPS = 5
TRAIN_LOSS_TOL = 1e-5  # fp32, per-pair losses ~0.69
TRAIN_WEIGHT_TOL = 1e-5  # fp32, after 5 SGD steps that move some weight by > 1e-3 (checked)
QLORA_CHECK = "llama 4-bit LoRA bfloat16"
QLORA_NEEDS = ("bitsandbytes", "peft", "trl")  # the quantized load, the adapters, TRL's configs
FAILING = ("FAIL", "error")


@dataclass
class CheckResult:
    """One line of the table. status: ok | FAIL | error | n/a (unsupported by design) | skipped (time)."""

    section: str
    name: str
    status: str
    detail: str = ""
    numbers: dict = field(default_factory=dict)


def attention_backends() -> list[str]:
    """The GPU backends to check, in order: flex, varlen (only where this install has it), sdpa."""
    from prefixdpo.core.attention.backends import BACKENDS

    return [b for b in ("flex", "varlen", "sdpa") if b in BACKENDS]


def bench_profiles() -> list[str]:
    from prefixdpo.data.synthetic import BENCH_PROFILES

    return list(BENCH_PROFILES)


def planned_checks(backends: list[str] | None = None, sections=SECTIONS) -> list[tuple[str, str]]:
    """(section, name) of every check a run would make, in run order."""
    backends = attention_backends() if backends is None else backends
    plan: list[tuple[str, str]] = []
    if "verify" in sections:
        plan += [("verify", f"{arch} {dtype} {b}") for arch in ARCHS for dtype in DTYPES for b in backends]
    if "train" in sections:
        plan += [("train", f"llama float32 {b}") for b in backends] + [("train", QLORA_CHECK)]
    if "bench" in sections:
        plan += [("bench", f"{p} {b}") for p in bench_profiles() for b in backends]
    if "grpo" in sections:
        plan += [("grpo verify", f"{arch} {dtype} {b}") for arch in GRPO_ARCHS for dtype in DTYPES for b in backends]
        plan += [("grpo bench", f"{p} {b}") for p in GRPO_PROFILES for b in backends]
        plan += [("grpo bench", f"whole step {GRPO_PROFILES[0]}")]
    return plan


def format_table(results: list[CheckResult]) -> str:
    """Fixed-width text table: section, check, status, detail (one line per check)."""
    header = ("section", "check", "status", "detail")
    rows = [header] + [(r.section, r.name, r.status, r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:{widths[0]}}  {b:{widths[1]}}  {c:{widths[2]}}  {d}".rstrip() for a, b, c, d in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def markdown_report(results: list[CheckResult], meta: dict) -> str:
    """Markdown: the run's facts, then one table per section, then the verdict."""
    lines = ["# prefixdpo gpu-check", ""] + [f"- {k}: {v}" for k, v in meta.items()]
    for section in TABLES:
        rows = [r for r in results if r.section == section]
        if not rows:
            continue
        lines += ["", f"## {section}", "", "| check | status | detail |", "|---|---|---|"]
        lines += [f"| {r.name} | {r.status} | {r.detail.replace('|', '/')} |" for r in rows]
    lines += ["", f"verdict: {verdict(results)}", ""]
    return "\n".join(lines)


def _is_exactness(section: str) -> bool:
    """verify, train, grpo verify: checks that fail the run; the benches only measure."""
    return not section.endswith("bench")


def verdict(results: list[CheckResult]) -> str:
    bad = [r for r in results if _is_exactness(r.section) and r.status in FAILING]
    return f"FAIL: {len(bad)} exactness check(s) failed" if bad else "all exactness checks passed"


def exit_status(results: list[CheckResult]) -> int:
    """1 if an exactness check (verify, train, grpo verify) failed or raised; bench results never fail the run."""
    return int(any(_is_exactness(r.section) and r.status in FAILING for r in results))


def write_reports(results: list[CheckResult], meta: dict, out: str | os.PathLike) -> list[Path]:
    """Write DIR/gpu-check.json (every number) and DIR/gpu-check.md; returns their paths."""
    out = Path(out)
    js, md = out / "gpu-check.json", out / "gpu-check.md"
    atomic_write_text(str(js), json.dumps({"meta": meta, "verdict": verdict(results),
                                           "results": [asdict(r) for r in results]}, indent=2))
    atomic_write_text(str(md), markdown_report(results, meta))
    return [js, md]


# ---------------------------------------------------------------------------------------------- checks


def tiny_causal_lm(arch: str, dtype: torch.dtype, device: str):
    """A tiny random model of `arch` (GQA where the architecture has it; Gemma-2 keeps its default
    soft-capping). Initialised at std 0.2 so a wrong layout shows in the log-probs, then cast."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kwargs), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.to(device=device, dtype=dtype).train(False)


def verify_examples():
    """Three records, K = 2, 4, 2 (best vs each), prompts 7-9 tokens, responses 2-8 tokens."""
    from prefixdpo.data.example import Example

    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, rs) in enumerate(((7, (5, 3)), (4, (6, 2, 3, 4)), (9, (2, 8)))):
        ids = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (p, *rs)]
        out.append(Example(ids[0], ids[1:], pairs=[(0, k) for k in range(1, len(rs))], source_index=i))
    return out


def verify_check(arch: str, dtype_name: str, backend: str, device: str) -> CheckResult:
    """`prefixdpo verify`'s four cases on a tiny `arch`; n/a where the backend refuses the model."""
    from prefixdpo.core.verify import DTYPE_TOLERANCES
    from prefixdpo.core.model_checks import check_model_supported
    from prefixdpo.core.logprobs import UnsupportedModelError
    from prefixdpo.core.verify import compare

    name = f"{arch} {dtype_name} {backend}"
    model = tiny_causal_lm(arch, getattr(torch, dtype_name), device)
    try:
        check_model_supported(model, backend)
    except UnsupportedModelError as err:
        return CheckResult("verify", name, "n/a", str(err))
    logp_tol, grad_tol = DTYPE_TOLERANCES[dtype_name]
    examples = verify_examples()
    n = len(examples)
    cases = [("unpacked", None, True), ("packed", [list(range(n))], True),
             ("two rows", [[0, 2], [1]], True), ("standard packed", [list(range(n))], False)]
    worst = {"logp": 0.0, "grad": 0.0}
    failed = []
    for case, packs, sharing in cases:
        r = compare(model, examples, packs=packs, backend=backend, case=case, prefix_sharing=sharing,
                    pad_multiple=128 if backend == "flex" else 1)
        worst["logp"] = max(worst["logp"], r.logp_diff / max(1.0, r.logp_scale))
        if r.grad_diff is not None:
            worst["grad"] = max(worst["grad"], r.grad_diff / max(1.0, r.grad_scale))
        if not r.ok(logp_tol, grad_tol):
            failed.append(case)
    detail = (f"rel dlogp {worst['logp']:.1e} (tol {logp_tol:g}), rel dgrad {worst['grad']:.1e} (tol {grad_tol:g})"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
    return CheckResult("verify", name, "FAIL" if failed else "ok", detail, worst)


def train_check(backend: str, device: str, steps: int = TRAIN_STEPS) -> CheckResult:
    """`steps` SGD steps from the same weights, standard pairs ("paired") vs prefix-shared packed rows
    ("shared-packed", one line per step), fp32: per-step mean losses and final weights compared."""
    from prefixdpo.bench.modes import layout_group
    from prefixdpo.bench.step import dpo_losses
    from prefixdpo.data.synthetic import synthetic_examples
    from prefixdpo.core.model_checks import prepare_model

    name = f"llama float32 {backend}"
    base = tiny_causal_lm("llama", torch.float32, device)
    reference = copy.deepcopy(base).requires_grad_(False)
    # Each step: one K = 2 record and one K = 4 record (best vs each), lengths capped short.
    pairwise = synthetic_examples("hh-rlhf", steps, vocab_size=96, seed=1, max_length=48)
    multi = synthetic_examples("ultrafeedback-k4", steps, vocab_size=96, seed=2, max_length=64)
    examples = [ex for pair in zip(pairwise, multi) for ex in pair]
    groups = [examples[2 * i: 2 * i + 2] for i in range(steps)]
    prepare_model(reference, backend)
    runs = {}
    for mode in ("paired", "shared-packed"):
        policy = copy.deepcopy(base).train()
        prepare_model(policy, backend)
        # lr 0.02: the largest weight moves ~2e-2 in 5 steps (measured, CPU), far above TRAIN_WEIGHT_TOL,
        # while rounding differences stay ~1e-7 (lr 1.0 made the two runs diverge chaotically).
        opt = torch.optim.SGD(policy.parameters(), lr=0.02)
        losses = []
        for group in groups:
            batch = layout_group(group, mode, pack_length=None, bucketed=backend == "flex").to(device)
            loss = dpo_losses(policy, reference, batch, backend=backend).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        runs[mode] = (losses, torch.cat([p.detach().flatten() for p in policy.parameters()]))
    (la, wa), (lb, wb) = runs["paired"], runs["shared-packed"]
    w0 = torch.cat([p.detach().flatten() for p in base.parameters()])
    nums = {"loss_diff": max(abs(a - b) for a, b in zip(la, lb)), "weight_diff": float((wa - wb).abs().max()),
            "weight_moved": float((wa - w0).abs().max()), "losses_paired": la, "losses_shared": lb}
    ok = (nums["loss_diff"] <= TRAIN_LOSS_TOL and nums["weight_diff"] <= TRAIN_WEIGHT_TOL
          and nums["weight_moved"] > 1e-3)
    detail = (f"{steps} steps: max |dloss| {nums['loss_diff']:.1e} (tol {TRAIN_LOSS_TOL:g}), max |dW| "
              f"{nums['weight_diff']:.1e} (tol {TRAIN_WEIGHT_TOL:g}), weights moved {nums['weight_moved']:.1e}")
    return CheckResult("train", name, "ok" if ok else "FAIL", detail, nums)


def qlora_check(device: str, steps: int = 3) -> CheckResult:
    """QLoRA the way `prefixdpo train --use_peft --load_in_4bit --dtype bfloat16 --bf16 true` runs it: TRL's
    quantization and PEFT configs built from `DPOModelArguments`, the model loaded in 4 bit by `load_causal_lm` on
    this process's device, `steps` AdamW steps of `PrefixDPOTrainer` (bf16 on CUDA). Passes when the model holds
    4-bit weights on `device`, the first loss is ln 2 (the reference is the model with its adapter off), every
    loss is finite, the adapters moved and the 4-bit base weights did not. Skipped with one line where
    bitsandbytes, peft or TRL is not installed."""
    missing = [name for name in QLORA_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        return CheckResult("train", QLORA_CHECK, "skipped", f"{', '.join(missing)} not installed")
    import math
    import tempfile

    from prefixdpo.core.models import load_causal_lm
    from prefixdpo.data.synthetic import synthetic_examples
    from prefixdpo.dpo.config import DPOModelArguments, PrefixDPOConfig
    from prefixdpo.dpo.trainer import PrefixDPOTrainer

    with tempfile.TemporaryDirectory() as folder:
        tiny_causal_lm("llama", torch.float32, "cpu").save_pretrained(folder)
        model_args = DPOModelArguments(model_name_or_path=folder, use_peft=True, load_in_4bit=True, dtype="bfloat16",
                                       lora_r=8, lora_target_modules=["all-linear"])
        args = PrefixDPOConfig(output_dir=os.path.join(folder, "out"), max_steps=steps, per_device_train_batch_size=2,
                               learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                               bf16=device == "cuda", disable_tqdm=True, gradient_checkpointing=False, seed=0)
        model = load_causal_lm(folder, model_init_kwargs=model_args.from_pretrained_kwargs(
            None, False, args.local_process_index))
        on_device = next(model.parameters()).device.type == device
        packed = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.uint8}
        examples = synthetic_examples("hh-rlhf", 2 * steps, vocab_size=96, seed=1, max_length=48)
        trainer = PrefixDPOTrainer(model=model, args=args, train_dataset=examples,
                                   peft_config=model_args.peft_config())
        adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.train()
        now = dict(trainer.model.named_parameters())
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        base_moved = [n for n, p in packed.items() if not torch.equal(now[_peft_name(n, now)].detach(), p)]
        nums = {"losses": losses, "packed_weights": len(packed), "base_moved": len(base_moved),
                "adapters_moved": sum(not torch.equal(now[n].detach(), p) for n, p in adapters.items()),
                "adapter_dtypes": sorted({str(now[n].dtype) for n in adapters})}
    ok = (bool(packed) and on_device and not base_moved and nums["adapters_moved"] > 0 and len(losses) == steps
          and all(math.isfinite(x) for x in losses) and abs(losses[0] - math.log(2)) < 1e-2)
    detail = (f"{len(packed)} 4-bit weights on {device if on_device else 'another device'} (unchanged: "
              f"{not base_moved}), {nums['adapters_moved']} of "
              f"{len(adapters)} adapter tensors moved ({', '.join(nums['adapter_dtypes'])}), losses "
              + " ".join(f"{x:.4f}" for x in losses))
    return CheckResult("train", QLORA_CHECK, "ok" if ok else "FAIL", detail, nums)


def _peft_name(name: str, named: dict) -> str:
    """A base model parameter's name inside its PEFT wrapper (`base_model.model.` prefix, `.base_layer`)."""
    prefixed = f"base_model.model.{name}"
    if prefixed in named:
        return prefixed
    module, _, leaf = prefixed.rpartition(".")
    return f"{module}.base_layer.{leaf}"


def graphs_compiled() -> int:
    """Graphs dynamo has compiled so far in this process (each recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def bench_detail(r) -> tuple[str, dict]:
    """One table cell and the JSON numbers of a `bench.runner.ProfileResult`."""
    m = r.modes
    sp = r.speedups["shared_packed_vs_paired_packed"].median
    nums = {
        "pairs_per_s": {k: v.pairs_per_s.median for k, v in m.items()},
        "peak_mb": {k: v.peak_mb for k, v in m.items()},
        "speedups": {k: v.median for k, v in r.speedups.items()},
        "ideal": r.ideal, "achieved_over_ideal": r.achieved_over_ideal, "pack_length": r.pack_length,
    }
    detail = ("pairs/s " + " / ".join(f"{v.pairs_per_s.median:.1f}" for v in m.values())
              + f" (paired/pp/shared/sp); sp/pp {sp:.2f}, ideal {r.ideal:.2f}, achieved/ideal "
              f"{r.achieved_over_ideal:.2f}; peak {max(v.peak_mb for v in m.values()) / 1024:.1f} GiB")
    return detail, nums


def bench_section(backends: list[str], device: str, deadline: float, *, examples: int, per_step: int,
                  repeats: int, warmup: int, log=print) -> list[CheckResult]:
    """Every profile x backend on BENCH_SHAPE in bf16, until `deadline` (time.monotonic())."""
    from prefixdpo.bench.model import build_models
    from prefixdpo.bench.runner import run_workload
    from prefixdpo.bench.step import DPOStep
    from prefixdpo.bench.workloads import synthetic_workload
    from prefixdpo.core.model_checks import prepare_model

    results = []
    policy, reference, shape = build_models(BENCH_SHAPE, device=device, dtype=torch.bfloat16, backend=backends[0])
    for profile in bench_profiles():
        w = synthetic_workload(profile, examples, per_step, vocab_size=shape.vocab, max_length=BENCH_MAX_LENGTH)
        for backend in backends:
            name = f"{profile} {backend}"
            if time.monotonic() > deadline:
                results.append(CheckResult("bench", name, "skipped", "time budget spent"))
                continue
            stepper = None
            try:
                prepare_model(policy, backend)
                prepare_model(reference, backend)
                stepper = DPOStep(policy, reference, backend=backend)
                g0, t0 = graphs_compiled(), time.monotonic()
                r = run_workload(w, stepper, shape, device=device, repeats=repeats, warmup=warmup)
                detail, nums = bench_detail(r)
                nums["graphs_compiled"] = graphs_compiled() - g0
                nums["wall_s"] = time.monotonic() - t0
                results.append(CheckResult("bench", name, "ok",
                                           detail + f"; graphs compiled {nums['graphs_compiled']}", nums))
            except Exception as err:  # noqa: BLE001  (one backend's failure must not hide the others' numbers)
                results.append(CheckResult("bench", name, "error", f"{type(err).__name__}: {err}"[:300]))
            finally:
                stepper = None  # frees the optimizer state before the next backend's
                torch.cuda.empty_cache()
            log(f"  {results[-1].name}: {results[-1].status} {results[-1].detail}")
    return results


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
    from prefixdpo import gpu_check_grpo as grpo

    results = []
    for arch in GRPO_ARCHS:
        for dtype in DTYPES:
            for b in backends:
                results.append(_guarded("grpo verify", f"{arch} {dtype} {b}", grpo.verify_check, arch, dtype, b, device,
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


def _guarded(section: str, name: str, fn, *args) -> CheckResult:
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001  (an exactness check that raises is a failure with its message)
        return CheckResult(section, name, "error", f"{type(err).__name__}: {err}"[:300])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-results",
                   help="directory for gpu-check.json and gpu-check.md (default $OUT, else gpu-check-results)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="seconds after which remaining bench runs are skipped (default 450)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of verify,train,bench")
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
    if torch is None:
        print("gpu-check: torch is not installed for this python: nothing checked")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device (torch {torch.__version__}): nothing checked; run it on a GPU machine")
        return 0

    import transformers

    start = time.monotonic()
    device = "cuda"
    backends = attention_backends()
    meta = {
        "device": f"{torch.cuda.get_device_name()} (python {platform.python_version()}, torch {torch.__version__}, "
                  f"transformers {transformers.__version__})",
        "backends": ", ".join(backends),
        "bench model": (f"random Llama-shaped: hidden {BENCH_SHAPE.hidden}, intermediate {BENCH_SHAPE.intermediate}, "
                        f"{BENCH_SHAPE.layers} layers, {BENCH_SHAPE.heads}/{BENCH_SHAPE.kv_heads} heads, head_dim "
                        f"{BENCH_SHAPE.head_dim}, vocab {BENCH_SHAPE.vocab}, bf16; rows <= {BENCH_MAX_LENGTH} tokens; "
                        f"{args.bench_examples} examples, {args.bench_per_step} per step, 1 warm-up + "
                        f"{args.bench_repeats} counted passes"),
    }
    print(f"gpu-check: {meta['device']}; backends {meta['backends']}; {len(planned_checks(backends, sections))} checks")
    results: list[CheckResult] = []

    def log(line):
        print(line, flush=True)

    if "verify" in sections:
        for arch in ARCHS:
            for dtype in DTYPES:
                for b in backends:
                    results.append(_guarded("verify", f"{arch} {dtype} {b}", verify_check, arch, dtype, b, device))
                    log(f"  verify {results[-1].name}: {results[-1].status} {results[-1].detail}")
    if "train" in sections:
        for b in backends:
            results.append(_guarded("train", f"llama float32 {b}", train_check, b, device))
            log(f"  train {results[-1].name}: {results[-1].status} {results[-1].detail}")
        results.append(_guarded("train", QLORA_CHECK, qlora_check, device))
        log(f"  train {results[-1].name}: {results[-1].status} {results[-1].detail}")
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
    meta["wall"] = f"{time.monotonic() - start:.0f} s"
    print()
    print(format_table(results))
    print(f"verdict: {verdict(results)}")
    paths = write_reports(results, meta, args.out)
    print("wrote " + ", ".join(str(x) for x in paths))
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
