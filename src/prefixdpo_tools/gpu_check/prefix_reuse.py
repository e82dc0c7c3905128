"""gpu-check's prefix-reuse section (`core.prefix_reuse`): what the CPU suite cannot run.

- "reuse <arch> <backend>": one micro-batch of two long lines (a 1,536- and a 1,024-token prompt with 8 and 6
  responses of 64-200 tokens), the policy pass and its backward as one row each, then with prefix reuse at a budget
  of about two responses per chunk (3-5 chunks a line): the per-response log-prob sums and every parameter gradient
  must agree, within `core.verify.DTYPE_TOLERANCES` of the dtype (fp32; varlen's kernel only takes bf16) - the same
  bound `prefixdpo verify` holds a layout to. On CUDA this is the only run of flex's and varlen's masks over
  external keys (`queries_from`): flex's chunk masks do not compile on CPU (torch 2.13's inductor), and varlen is
  CUDA-only. Reports each pass's `max_memory_allocated` too (reused over one row).
"""

from __future__ import annotations

import torch

from prefixdpo_tools.gpu_check.results import CheckResult, guarded

__all__ = ["ARCHS", "planned", "reuse_check", "section"]

ARCHS = ("llama", "qwen2")
BUDGET = 2 * 200 + 16  # tokens per chunk pass: about two of the longest responses


def planned(backends: list[str]) -> list[tuple[str, str]]:
    return [("prefix reuse", f"reuse {arch} {b}") for arch in ARCHS for b in backends]


def _batch(device: str):
    from prefixdpo.data.batch import build_batch
    from prefixdpo.data.example import Example

    g = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 90, (n,), generator=g).tolist()

    def record(prompt: int, responses: int) -> Example:
        lengths = torch.randint(64, 201, (responses,), generator=g).tolist()
        return Example(ids(prompt), [ids(n) for n in lengths], pairs=tuple((k, k + 1) for k in range(0, responses, 2)))

    return build_batch([record(1536, 8), record(1024, 6)], prefix_sharing=True, pad_token_id=0).to(device)


def _pass(model, batch, mask, device: str):
    """(sums [R] fp32, every parameter gradient flattened, max allocated bytes) of one policy pass and backward."""
    from prefixdpo.core.forward import compute_response_logps

    cuda = torch.device(device).type == "cuda"
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    out = compute_response_logps(model, batch, mask)
    weights = torch.linspace(1.0, 2.0, out.sums.numel(), device=out.sums.device)
    (out.sums.float() * weights).sum().backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return out.sums.detach().float(), grads, torch.cuda.max_memory_allocated(device) if cuda else 0


def reuse_check(arch: str, backend: str, device: str) -> CheckResult:
    """See the module docstring ("reuse <arch> <backend>")."""
    from prefixdpo.core.attention.pass_plan import plan_pass
    from prefixdpo.core.model_checks import prepare_model
    from prefixdpo.core.verify import DTYPE_TOLERANCES
    from prefixdpo_tools.gpu_check.tiny_models import tiny_causal_lm

    dtype = torch.bfloat16 if backend == "varlen" else torch.float32
    model = tiny_causal_lm(arch, dtype, device)
    model.config.max_position_embeddings = 4096
    prepare_model(model, backend)
    batch = _batch(device)
    reuse = plan_pass(batch, backend, max_tokens_per_pass=BUDGET)
    chunks = [len(p.chunks) for p in reuse.reuse.plans if p is not None]
    one_sums, one_grads, one_peak = _pass(model, batch, plan_pass(batch, backend), device)
    sums, grads, peak = _pass(model, batch, reuse, device)
    logp_tol, grad_tol = DTYPE_TOLERANCES[str(dtype).removeprefix("torch.")]
    sum_diff = float((sums - one_sums).abs().max() / one_sums.abs().max())
    grad_diff = float((grads - one_grads).abs().max() / one_grads.abs().max())
    ok = sum_diff <= logp_tol and grad_diff <= grad_tol
    peak_ratio = peak / one_peak if one_peak else None  # CUDA's allocator only
    detail = (f"{dtype} chunks {chunks}: sums rel {sum_diff:.3g} (bound {logp_tol}), gradients rel {grad_diff:.3g} "
              f"(bound {grad_tol})" + ("" if peak_ratio is None else f"; peak allocated reused / one row {peak_ratio:.2f}"))
    return CheckResult("prefix reuse", f"reuse {arch} {backend}", "ok" if ok else "FAIL", detail,
                       {"sum_rel": sum_diff, "grad_rel": grad_diff, "chunks": chunks, "peak_ratio": peak_ratio})


def section(backends: list[str], device: str, log=print) -> list[CheckResult]:
    results = []
    for arch in ARCHS:
        for b in backends:
            results.append(guarded("prefix reuse", f"reuse {arch} {b}", reuse_check, arch, b, device))
            log(f"  prefix reuse {results[-1].name}: {results[-1].status} {results[-1].detail}")
    return results
