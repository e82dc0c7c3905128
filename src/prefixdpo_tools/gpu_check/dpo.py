"""The DPO sections of `make gpu-check` (`prefixdpo_tools.gpu_check.main` runs them).

- verify: `prefixdpo verify`'s cases on tiny Llama, Qwen2, Qwen3, Mistral and Gemma-2 per dtype and backend
  (`verify_check`);
- train: a few SGD steps, standard pairs vs prefix-shared packed rows, from the same weights (`train_check`), and
  QLoRA as `prefixdpo train --use_peft --load_in_4bit` runs it (`qlora_check`);
- bench: `prefixdpo bench`'s DPO step on a compute-bound Llama shape, every profile x backend until a deadline
  (`bench_section`).

Imports only torch, transformers and prefixdpo's own modules at module level (see the package doc).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import time

try:
    import torch
except ImportError:  # `make gpu-check` on a python without torch: main() says so in one line
    torch = None

from prefixdpo_tools.bench.flops import ModelShape
from prefixdpo_tools.gpu_check.results import CheckResult, fresh_compile_state
from prefixdpo_tools.gpu_check.tiny_models import tiny_causal_lm

__all__ = ["ARCHS", "DTYPES", "BENCH_SHAPE", "QLORA_CHECK", "bench_profiles", "verify_check", "train_check",
           "qlora_check", "bench_section"]

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2")
DTYPES = ("float32", "bfloat16")
# Llama-shaped and compute-bound on one H200 in bf16 (~0.45 G body weights per token, GQA 4:1,
# head_dim 128 as Llama-3), small enough that the seven profiles x four modes fit the time budget.
BENCH_SHAPE = ModelShape(hidden=2048, intermediate=7168, layers=8, heads=16, kv_heads=4, head_dim=128, vocab=32000)
BENCH_MAX_LENGTH = 4096
TRAIN_STEPS = 5
TRAIN_LOSS_TOL = 1e-5  # fp32, per-pair losses ~0.69
TRAIN_WEIGHT_TOL = 1e-5  # fp32, after 5 SGD steps that move some weight by > 1e-3 (checked)
QLORA_CHECK = "llama 4-bit LoRA bfloat16"
QLORA_NEEDS = ("bitsandbytes", "peft", "trl")  # the quantized load, the adapters, TRL's configs


def bench_profiles() -> list[str]:
    from prefixdpo.data.synthetic import BENCH_PROFILES

    return list(BENCH_PROFILES)


def verify_examples():
    """Three records, K = 2, 4, 2 (best vs each), prompts 7-9 tokens, responses 2-8 tokens."""
    from prefixdpo.data.example import Example

    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, rs) in enumerate(((7, (5, 3)), (4, (6, 2, 3, 4)), (9, (2, 8)))):
        ids = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (p, *rs)]
        out.append(Example(ids[0], ids[1:], pairs=[(0, k) for k in range(1, len(rs))], source_index=i))
    return out


def verify_check(arch: str, dtype_name: str, backend: str, device: str, build=tiny_causal_lm, examples=None,
                 section: str = "verify") -> CheckResult:
    """`prefixdpo verify`'s four cases on a tiny `arch` (`build(arch, dtype, device)`, on `examples`, default
    `verify_examples()`); n/a where the backend refuses the model."""
    from prefixdpo.core.verify import DTYPE_TOLERANCES
    from prefixdpo.core.model_checks import check_model_supported
    from prefixdpo.core.logprobs import UnsupportedModelError
    from prefixdpo.core.verify import compare

    name = f"{arch} {dtype_name} {backend}"
    model = build(arch, getattr(torch, dtype_name), device)
    try:
        check_model_supported(model, backend)
    except UnsupportedModelError as err:
        return CheckResult(section, name, "n/a", str(err))
    logp_tol, grad_tol = DTYPE_TOLERANCES[dtype_name]
    examples = verify_examples() if examples is None else examples
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
    return CheckResult(section, name, "FAIL" if failed else "ok", detail, worst)


def train_check(backend: str, device: str, steps: int = TRAIN_STEPS) -> CheckResult:
    """`steps` SGD steps from the same weights, standard pairs ("paired") vs prefix-shared packed rows
    ("shared-packed", one line per step), fp32: per-step mean losses and final weights compared."""
    from prefixdpo_tools.bench.modes import layout_group
    from prefixdpo_tools.bench.step import dpo_losses
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
    from prefixdpo_tools.bench.model import build_models
    from prefixdpo_tools.bench.runner import run_workload
    from prefixdpo_tools.bench.step import DPOStep
    from prefixdpo_tools.bench.workloads import synthetic_workload
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
                fresh_compile_state()
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

