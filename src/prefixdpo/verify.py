"""Check prefix sharing against standard separate forward passes on a user's own model.

The reference is deliberately independent of prefixdpo's forward: each `[prompt][response]` runs alone
through the model's stock attention (no custom mask, default positions), and log-probs come from the
model's full logits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo.forward import compute_response_logps, prepare_model, unwrap


@contextlib.contextmanager
def stock_attention(model, implementation: str = "sdpa"):
    """Temporarily give the model a stock transformers attention implementation."""
    base = unwrap(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    previous = base.config._attn_implementation
    base.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        base.set_attn_implementation(previous)


def separate_pass_logps(model, examples: list[Example]) -> torch.Tensor:
    """Standard log-prob sums [R] (responses in example order), one plain causal pass per response."""
    device = next(model.parameters()).device
    sums = []
    with stock_attention(model):
        for ex in examples:
            for response in ex.response_ids:
                ids = torch.tensor([list(ex.prompt_ids) + list(response)], device=device)
                logits = model(input_ids=ids, use_cache=False).logits.float()[0]  # [n, V]
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
    logp_diff: float  # max |shared - separate| over responses (log-prob sums)
    logp_scale: float  # largest |separate log-prob sum|
    grad_diff: float  # max |shared - separate| over all gradient entries
    grad_scale: float  # largest |separate gradient entry|

    def ok(self, logp_tol: float, grad_tol: float) -> bool:
        """Both diffs within tolerance, relative to max(1, scale) so long responses are not penalised."""
        return (self.logp_diff <= logp_tol * max(1.0, self.logp_scale)
                and self.grad_diff <= grad_tol * max(1.0, self.grad_scale))


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def compare(
    model, examples: list[Example], *, packs=None, backend: str = "sdpa", restart_positions: bool = True,
    case: str = "", pad_multiple: int = 1,
) -> VerifyResult:
    """Max abs diff of per-response logps and of DPO-loss gradients, prefix-shared vs separate passes.

    restart_positions=False deliberately breaks the layout (positions run on through the row): used to
    show the check catches a wrong setup.
    """
    device = next(model.parameters()).device
    batch = build_batch(examples, prefix_sharing=True, packs=packs, pad_multiple=pad_multiple)
    if not restart_positions:
        L = batch.input_ids.shape[1]
        batch.position_ids = torch.arange(L).expand_as(batch.input_ids).clone()
    batch = batch.to(device)

    model.zero_grad(set_to_none=True)
    reference = separate_pass_logps(model, examples)
    dpo_loss(reference, batch.pair_better, batch.pair_worse).backward()
    reference_grads = _grads(model).clone()

    model.zero_grad(set_to_none=True)
    prepare_model(model, backend)
    shared = compute_response_logps(model, batch, backend=backend).sums
    dpo_loss(shared, batch.pair_better, batch.pair_worse).backward()
    shared_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    return VerifyResult(
        case=case,
        logp_diff=(shared.detach() - reference.detach()).abs().max().item(),
        logp_scale=reference.detach().abs().max().item(),
        grad_diff=(shared_grads - reference_grads).abs().max().item(),
        grad_scale=reference_grads.abs().max().item(),
    )
