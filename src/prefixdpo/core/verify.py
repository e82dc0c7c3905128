"""Check prefix sharing against standard separate forward passes on a user's own model.

The reference is deliberately independent of prefixdpo's forward: each `[prompt][response]` runs alone
through the model's stock attention (no custom mask, default positions), and log-probs come from the
model's full logits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from prefixdpo.core.attention.backends import resolve_backend
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.data.batch import Batch, build_batch
from prefixdpo.data.tree import build_tree_batch
from prefixdpo.data.example import Example
from prefixdpo.core.model_checks import base_model, prepare_model, text_config
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.vml_warmup import warm_up as warm_up_vml


DTYPE_TOLERANCES = {  # (logp relative tolerance, gradient tolerance relative to the largest gradient entry)
    "float32": (1e-5, 1e-4),
    "bfloat16": (5e-2, 5e-2),
    "float16": (1e-2, 1e-2),
}


def stock_implementation(model) -> str:
    """The stock attention the model itself supports for the comparison passes: "sdpa", or "eager" where
    the architecture has no SDPA support (transformers refuses it) or soft-caps attention logits (SDPA has
    no soft-capping, so transformers' eager path is the model's reference semantics)."""
    base = base_model(model)
    cfg = text_config(base)
    if not getattr(base, "_supports_sdpa", False) or getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "eager"
    return "sdpa"


@contextlib.contextmanager
def stock_attention(model, implementation: str | None = None):
    """Temporarily give the model a stock transformers attention implementation (default:
    `stock_implementation(model)`)."""
    base = base_model(model)
    previous = base.config._attn_implementation
    base.set_attn_implementation(implementation or stock_implementation(model))
    try:
        yield model
    finally:
        base.set_attn_implementation(previous)


def stock_sequences(model, examples: list[Example]):
    """Yield (example, ids [1, n]) for every `[prompt][response]` sequence, responses in example order, on the
    model's device; the model has its stock attention while the caller runs it on each."""
    device = next(model.parameters()).device
    with stock_attention(model):
        for ex in examples:
            for response in ex.response_ids:
                yield ex, torch.tensor([list(ex.prompt_ids) + list(response)], device=device)


def separate_pass_logps(model, examples: list[Example]) -> torch.Tensor:
    """Standard log-prob sums [R] (responses in example order), one plain causal pass per response."""
    warm_up_vml()  # this may be the process's first forward (prefixdpo.core.vml_warmup)
    sums = []
    for ex, ids in stock_sequences(model, examples):
        logits = model(input_ids=ids, use_cache=False).logits[0]  # [n, V]
        if logits.dtype in (torch.float16, torch.bfloat16):  # fp32 at least, fp64 kept for fp64 checks
            logits = logits.float()
        p = len(ex.prompt_ids)
        logps = logits[p - 1:-1].log_softmax(-1)  # positions predicting the response
        sums.append(logps.gather(1, ids[0, p:, None]).sum())
    return torch.stack(sums)


def dpo_loss(logps: torch.Tensor, better: torch.Tensor, worse: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """A reference-free DPO-shaped loss used only to compare gradients: mean -logsigmoid(beta*(lb - lw))."""
    return -torch.nn.functional.logsigmoid(beta * (logps[better] - logps[worse])).mean()


@dataclass
class VerifyResult:
    case: str
    logp_diff: float  # max |ours - separate| over responses (log-prob sums)
    logp_scale: float  # largest |separate log-prob sum|
    grad_diff: float | None  # max |ours - separate| over all gradient entries; None = forward-only check
    grad_scale: float | None  # largest |separate gradient entry|

    def ok(self, logp_tol: float, grad_tol: float) -> bool:
        """Both diffs within tolerance, relative to max(1, scale) so long responses are not penalised."""
        logp_ok = self.logp_diff <= logp_tol * max(1.0, self.logp_scale)
        if self.grad_diff is None:
            return logp_ok
        return logp_ok and self.grad_diff <= grad_tol * max(1.0, self.grad_scale)


def gradients(model) -> torch.Tensor:
    """Every parameter's gradient, flat (those that have one)."""
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def verify_batch(examples: list[Example], *, packs=None, prefix_sharing: bool = True, tree: bool = False,
                 pad_multiple: int = 1, pad_token_id: int = 0, restart_positions: bool = True) -> Batch:
    """The layout a check runs `examples` on (see `compare`); restart_positions=False breaks it on purpose."""
    if tree:
        batch = build_tree_batch(examples, packs, pad_multiple=pad_multiple, pad_token_id=pad_token_id)
    else:
        batch = build_batch(examples, prefix_sharing=prefix_sharing, packs=packs, pad_multiple=pad_multiple,
                            pad_token_id=pad_token_id)
    if not restart_positions:
        batch.position_ids = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids).clone()
    return batch


def compare_passes(model, examples: list[Example], separate, ours, loss, *, backend: str = "sdpa", case: str = "",
                   **layout) -> VerifyResult:
    """Max abs diff of the per-response values and of a loss's gradients, our layout vs separate stock passes.

    separate(model, examples) -> [R]: the stock passes; ours(model, batch, mask) -> [R]: prefixdpo's pass on the
    layout (`verify_batch(examples, **layout)`); loss(values [R], batch) -> scalar. Gradients are compared only
    where the backend has a backward on the model's device (FlexAttention on CPU is forward only): otherwise
    `grad_diff` is None.
    """
    device = next(model.parameters()).device
    batch = verify_batch(examples, **layout).to(device)
    with_grad = not (backend == "flex" and device.type == "cpu")
    backend = resolve_backend(backend, device, needs_grad=with_grad)
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(with_grad):
        reference = separate(model, examples)
        prepare_model(model, backend)
        mine = ours(model, batch, plan_pass(batch, backend))
    result = VerifyResult(case=case, logp_diff=(mine - reference).detach().abs().max().item(),
                          logp_scale=reference.detach().abs().max().item(), grad_diff=None, grad_scale=None)
    if with_grad:
        grads = []
        for values in (reference, mine):
            loss(values, batch).backward()
            grads.append(gradients(model).clone())
            model.zero_grad(set_to_none=True)
        result.grad_diff = (grads[1] - grads[0]).abs().max().item()
        result.grad_scale = grads[0].abs().max().item()
    return result


def compare(
    model, examples: list[Example], *, packs=None, backend: str = "sdpa", restart_positions: bool = True,
    case: str = "", pad_multiple: int = 1, prefix_sharing: bool = True, tree: bool = False,
) -> VerifyResult:
    """Max abs diff of per-response logps and of DPO-loss gradients, our layout vs separate stock passes
    (`compare_passes`).

    prefix_sharing=False lays the standard `[prompt][response]` sequences out instead (each its own
    document; with `packs`, an example's sequences share its packed line), as training does without
    prefix sharing. tree=True lays each pack out as one token trie across its examples (`data.tree`, as training's
    `prefix_tree` does; packs None: all in one line). restart_positions=False deliberately breaks the layout
    (positions run on through the row): used to show the check catches a wrong setup.
    """
    return compare_passes(
        model, examples, separate_pass_logps, lambda m, batch, mask: compute_response_logps(m, batch, mask).sums,
        lambda values, batch: dpo_loss(values, batch.pair_better, batch.pair_worse), backend=backend, case=case,
        packs=packs, prefix_sharing=prefix_sharing, tree=tree, pad_multiple=pad_multiple,
        restart_positions=restart_positions)
