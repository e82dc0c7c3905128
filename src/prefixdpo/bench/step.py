"""A lean DPO training step, the same code for every benchmark mode.

policy forward + backward (with grad), reference forward (no grad), sigmoid DPO loss, AdamW step.
Both forwards go through `prefixdpo.forward.compute_response_logps` (the model's own body with our
attention, LM head only where a response token is predicted), with ONE attention mask built per step
and shared by the two passes. Nothing here knows which mode built the batch: any speed difference
between modes comes from the batch layout (prefix sharing, packing), not from different code.
"""

from __future__ import annotations

import torch

from prefixdpo.attention.backends import build_attention_mask, resolve_backend
from prefixdpo.data.batch import Batch
from prefixdpo.forward import compute_response_logps
from prefixdpo.losses import sigmoid_loss

__all__ = ["dpo_losses", "DPOStep"]


def dpo_losses(policy, reference, batch: Batch, *, backend: str, beta: float = 0.1, chunk_size: int = 1024,
               attention_mask=None) -> torch.Tensor:
    """Per-pair sigmoid DPO losses [P] (fp32) for `batch`; grad flows into `policy` if enabled.

    The reference pass runs under no_grad. The score of a response is its summed log-prob minus the
    reference's (TRL's sigmoid loss, beta-scaled margin of chosen over rejected).
    """
    if attention_mask is None:
        attention_mask = build_attention_mask(
            batch.doc_ids, batch.branch_ids, resolve_backend(backend, batch.input_ids.device, needs_grad=False))
    with torch.no_grad():
        ref = compute_response_logps(reference, batch, backend=backend, chunk_size=chunk_size,
                                     attention_mask=attention_mask).sums
    pol = compute_response_logps(policy, batch, backend=backend, chunk_size=chunk_size,
                                 attention_mask=attention_mask).sums
    better, worse = batch.pair_better, batch.pair_worse
    return sigmoid_loss(pol[better] - ref[better], pol[worse] - ref[worse], beta)


class DPOStep:
    """One optimizer step per call: `step(batch) -> loss` (mean over the batch's pairs).

    policy and reference: prepared models (`prefixdpo.forward.prepare_model`) on the batch's device.
    backend: "sdpa" (CPU) or "flex" (CUDA); the mask is built inside the step (its cost is timed).
    """

    def __init__(self, policy, reference, *, backend: str, lr: float = 1e-6, beta: float = 0.1,
                 chunk_size: int = 1024):
        self.policy = policy
        self.reference = reference
        self.backend = backend
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
        backend = resolve_backend(self.backend, batch.input_ids.device, needs_grad=True)
        mask = build_attention_mask(batch.doc_ids, batch.branch_ids, backend)
        loss = dpo_losses(self.policy, self.reference, batch, backend=backend, beta=self.beta,
                          chunk_size=self.chunk_size, attention_mask=mask).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())
