"""A lean DPO training step, the same code for every benchmark mode.

policy forward + backward (with grad), reference forward (no grad), sigmoid DPO loss, AdamW step.
The losses come from `prefixdpo.dpo.step.pair_losses`, the trainer's own micro-batch function (the model's
own body with our attention, LM head only where a response token is predicted, ONE attention mask per
step shared by the policy and reference passes). Nothing here knows which mode built the batch: any speed difference
between modes comes from the batch layout (prefix sharing, packing), not from different code.
"""

from __future__ import annotations

import torch

from prefixdpo.core.attention.backends import resolve_backend
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.data.batch import Batch
from prefixdpo.dpo.loss_table import LossParams
from prefixdpo.dpo.reference import Reference, SeparateModelReference
from prefixdpo.dpo.step import Objective, pair_losses

__all__ = ["dpo_losses", "DPOStep"]


def dpo_losses(policy, reference, batch: Batch, *, backend: str, beta: float = 0.1,
               chunk_size: int = 1024) -> torch.Tensor:
    """Per-pair sigmoid DPO losses [P] (fp32) for `batch`: the trainer's own `step.pair_losses`, with
    `reference` (a prepared frozen model, or a `Reference` a step reuses) as a separate reference model; grad
    flows into `policy` if enabled. The batch's one mask, for both passes, is built here."""
    backend = resolve_backend(backend, batch.input_ids.device, needs_grad=torch.is_grad_enabled())
    ref = reference if isinstance(reference, Reference) else SeparateModelReference(
        reference, chunk_size=chunk_size, backend=backend)
    mask = plan_pass(batch, backend)
    return pair_losses(policy, batch, mask, reference=ref, objective=Objective(params=LossParams(beta=beta)),
                       chunk_size=chunk_size).losses


class DPOStep:
    """One optimizer step per call: `step(batch) -> loss` (mean over the batch's pairs).

    policy and reference: prepared models (`prefixdpo.core.model_checks.prepare_model`) on the batch's device.
    backend: "sdpa"/"segmented" (CPU) or "flex" (CUDA), resolved once here; the mask is built inside the step
    (its cost is timed).
    """

    def __init__(self, policy, reference, *, backend: str, lr: float = 1e-6, beta: float = 0.1,
                 chunk_size: int = 1024):
        self.policy = policy
        self.backend = resolve_backend(backend, next(policy.parameters()).device, needs_grad=True)
        self.reference = SeparateModelReference(reference, chunk_size=chunk_size, backend=self.backend)
        self.beta = beta
        self.chunk_size = chunk_size
        params = [p for p in policy.parameters() if p.requires_grad]
        # fused: one kernel per step instead of ~10 elementwise passes (a fixed cost that would dilute
        # the layout differences this benchmark measures); falls back where fused is unsupported.
        try:
            self.optimizer = torch.optim.AdamW(params, lr=lr, fused=True)
        except (RuntimeError, ValueError):
            self.optimizer = torch.optim.AdamW(params, lr=lr)

    def step(self, batch: Batch) -> float:
        loss = dpo_losses(self.policy, self.reference, batch, backend=self.backend, beta=self.beta,
                          chunk_size=self.chunk_size).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())
