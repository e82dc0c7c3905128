"""The GRPO section of `make gpu-check` (`gpu_check.main` imports this only where TRL is installed).

- grpo verify: `prefixdpo verify --task grpo`'s cases (`grpo.verify`) on tiny Llama and Qwen2 in fp32 and bf16, per
  GPU backend: per-token log-probs, entropies and gradients of the prefix-shared pass against TRL's own
  `GRPOTrainer` pass (stock SDPA), at `verify`'s tolerances for the dtype.
- grpo bench: `prefixdpo bench --task grpo`'s CUDA mode (bf16, full lengths) on the bench's Llama shape, per backend,
  until the deadline, then the whole step (generation, reward-model scoring, training part; TRL's way and
  prefixdpo's, `bench.grpo_step`) on the first profile. Never fails the run.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from prefixdpo_tools.bench.grpo import (
    PROFILES,
    GroupTrainingStep,
    build_bench_trainer,
    run_profile,
    synthetic_rollouts,
)
from prefixdpo_tools.bench.grpo_step import time_whole_step
from prefixdpo_tools.bench.reward import build_reward_model
from prefixdpo_tools.bench.flops import ModelShape
from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
from prefixdpo_tools.bench.model import llama_config
from prefixdpo.core.models import load_causal_lm
from prefixdpo.grpo.verify import build_verify_trainer, compare_group_pass, random_group_rows, verify_cases
from prefixdpo_tools.gpu_check.results import CheckResult, fresh_compile_state
from prefixdpo_tools.gpu_check.tiny_models import tiny_causal_lm

VERIFY_ARCHS = ("llama", "qwen2")


def verify_check(arch: str, dtype_name: str, backend: str, device: str, tolerances: tuple[float, float]) -> CheckResult:
    """Every `verify --task grpo` case on a tiny `arch` (vocab 96) in `dtype_name` on `backend`."""
    name = f"{arch} {dtype_name} {backend}"
    model = tiny_causal_lm(arch, getattr(torch, dtype_name), device)
    tokenizer = build_tiny_tokenizer()
    rows = random_group_rows(model.config.vocab_size, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    logp_tol, grad_tol = tolerances
    worst = {"logp": 0.0, "entropy": 0.0, "grad": 0.0}
    failed = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-grpo-") as tmp:
        trainer = build_verify_trainer(model, tokenizer, backend, tmp, max_completion_length=rows.logits_to_keep)
        for case, options in verify_cases(rows):
            r = compare_group_pass(trainer, rows, case=case, **options)
            worst["logp"] = max(worst["logp"], r.logp_diff / max(1.0, r.logp_scale))
            worst["entropy"] = max(worst["entropy"], r.entropy_diff / max(1.0, r.entropy_scale))
            worst["grad"] = max(worst["grad"], r.grad_diff / max(1.0, r.grad_scale))
            if not r.ok(logp_tol, grad_tol):
                failed.append(case)
    detail = (f"rel dlogp {worst['logp']:.1e}, dentropy {worst['entropy']:.1e} (tol {logp_tol:g}), rel dgrad "
              f"{worst['grad']:.1e} (tol {grad_tol:g})" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return CheckResult("grpo verify", name, "FAIL" if failed else "ok", detail, worst)


def bench_section(backends: list[str], device: str, deadline: float, *, shape: ModelShape, length_scale: float,
                  rollouts: int, repeats: int, warmup: int, log=print) -> list[CheckResult]:
    """Every GRPO profile x backend (bf16 on CUDA, fp32 elsewhere) until `deadline` (time.monotonic()), then one
    whole-step timing. One trainer and model for all: the backend is the trainer's `attention` option."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    results: list[CheckResult] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-grpo-bench-") as tmp:
        torch.manual_seed(0)
        load_causal_lm(llama_config(shape), dtype=dtype).save_pretrained(Path(tmp) / "model")
        trainer = build_bench_trainer(str(Path(tmp) / "model"), build_tiny_tokenizer(), backend=backends[0],
                                      dtype=dtype, device=device, beta=0.04, num_iterations=1, group_size=2,
                                      output_dir=str(Path(tmp) / "out"))
    step = GroupTrainingStep(trainer, line_per_step=False)
    first = None
    for profile_name, profile in PROFILES.items():
        scaled = profile.scaled(length_scale)
        work = synthetic_rollouts(scaled, rollouts, vocab_size=shape.vocab)
        for backend in backends:
            name = f"{profile_name} {backend}"
            if time.monotonic() > deadline:
                results.append(CheckResult("grpo bench", name, "skipped", "time budget spent"))
                continue
            try:
                fresh_compile_state()
                trainer.change_settings(attention=backend)
                t0 = time.monotonic()
                r = run_profile(scaled, work, step, shape, device=device, repeats=repeats, warmup=warmup)
                nums = {"speedups": {k: v.median for k, v in r.speedups.items()}, "ideal": r.ideal.vs_trl_rows,
                        "sharing_alone": r.ideal.sharing_alone, "achieved_over_ideal": r.achieved_over_ideal,
                        "seconds_per_step": {m: v.seconds_per_step for m, v in r.modes.items()},
                        "peak_mb": {m: v.peak_mb for m, v in r.modes.items()}, "wall_s": time.monotonic() - t0}
                detail = ("s/step " + " / ".join(f"{v:.3f}" for v in nums["seconds_per_step"].values())
                          + f" (trl/shared/sp); sp/trl {nums['speedups']['shared_packed_vs_trl']:.2f}, ideal "
                          f"{r.ideal.vs_trl_rows:.2f}, achieved/ideal {r.achieved_over_ideal:.2f}")
                results.append(CheckResult("grpo bench", name, "ok", detail, nums))
                if first is None:
                    first = (r, work, backend)
            except Exception as err:  # noqa: BLE001  (one backend's failure must not hide the others' numbers)
                results.append(CheckResult("grpo bench", name, "error", f"{type(err).__name__}: {err}"[:300]))
            log(f"  grpo bench {results[-1].name}: {results[-1].status} {results[-1].detail}")
    if first is not None and time.monotonic() < deadline:
        results.append(_whole_step_result(trainer, first, shape, device, dtype, repeats=repeats, warmup=warmup))
        log(f"  grpo bench {results[-1].name}: {results[-1].status} {results[-1].detail}")
    return results


def _whole_step_result(trainer, first, shape: ModelShape, device: str, dtype, *, repeats: int,
                       warmup: int) -> CheckResult:
    """One whole GRPO step (generation, rewards, passes) timed against TRL's on the first profile that ran
    (`first`: its result, rollouts and backend)."""
    r, work, backend = first
    name = f"whole step {r.name}"
    try:
        fresh_compile_state()
        trainer.change_settings(attention=backend)
        reward_model, _ = build_reward_model(shape, device=device, dtype=dtype, backend=backend)
        w = time_whole_step(trainer, reward_model, r, work, shape, device=device, backend=backend,
                            repeats=repeats, warmup=warmup, pad_id=int(reward_model.config.pad_token_id))
        seconds = {p: (v.trl, v.ours) for p, v in w.phases.items()}
        detail = (" / ".join(f"{p} {a:.3f}->{b:.3f}" for p, (a, b) in seconds.items())
                  + f" s; whole step {w.speedup:.2f}x (ideal {w.ideals['whole_step']:.2f}); generation share "
                  f"{w.share('generation', 'trl'):.0%} -> {w.share('generation', 'ours'):.0%}; same tokens "
                  f"{w.same_tokens:.0%}")
        return CheckResult("grpo bench", name, "ok", detail,
                           {"seconds": seconds, "speedup": w.speedup, "ideals": w.ideals,
                            "share_trl": w.share("generation", "trl"), "same_tokens": w.same_tokens})
    except Exception as err:  # noqa: BLE001
        return CheckResult("grpo bench", name, "error", f"{type(err).__name__}: {err}"[:300])
