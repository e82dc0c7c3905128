"""One micro-batch of preference training as one pure function: policy log-probs, reference log-probs,
per-pair losses and their metric sums. The trainer and the benchmark both call `pair_losses`, so what is
benchmarked is what trains.

    batch --mask--> policy log-prob sums [R] (grad follows torch.is_grad_enabled())
          --reference strategy--> reference sums [R] (no grad; None for reference-free losses)
          --pairs (better, worse)--> PairLogps [P] --objective--> losses [P]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixdpo.attention.backends import build_attention_mask
from prefixdpo.data.batch import Batch
from prefixdpo.forward import compute_response_logps
from prefixdpo.objective import LossParams, PairLogps, combined_loss
from prefixdpo.metrics import pair_metric_sums


@dataclass(frozen=True)
class Objective:
    """What the losses are: TRL's `loss_type` list, its weights and the shared hyper-parameters."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] = (1.0,)
    params: LossParams = field(default_factory=LossParams)


@dataclass
class PairStep:
    """The result of one micro-batch. losses: [P]; pairs: the per-pair log-probs they were computed from."""

    losses: torch.Tensor
    pairs: PairLogps

    def metric_sums(self, beta: float) -> dict[str, float]:
        p = self.pairs
        return pair_metric_sums(p.policy_chosen_logps, p.policy_rejected_logps, p.ref_chosen_logps,
                                p.ref_rejected_logps, p.chosen_lengths, p.rejected_lengths, beta)


def pair_logps(policy, batch: Batch, *, reference, backend: str, chunk_size: int = 1024, item=None) -> PairLogps:
    """Per-pair log-prob sums [P] of `batch` under the policy and the reference.

    One attention mask serves both passes. `item["ref_logps"]` [R], when present (a precomputed table, or a
    pre-pass of this step), is used instead of running the reference again.
    """
    mask = build_attention_mask(batch.doc_ids, batch.branch_ids, backend)
    policy_logps = compute_response_logps(policy, batch, backend=backend, chunk_size=chunk_size, attention_mask=mask)
    if item is not None and "ref_logps" in item:
        ref = item["ref_logps"].to(batch.input_ids.device)
    else:
        ref = reference.logps(policy, batch, mask, item)
    sums, lengths = policy_logps.sums, policy_logps.counts.to(policy_logps.sums.dtype)
    b, w = batch.pair_better, batch.pair_worse
    return PairLogps(
        policy_chosen_logps=sums[b], policy_rejected_logps=sums[w],
        ref_chosen_logps=None if ref is None else ref[b].to(sums.dtype),
        ref_rejected_logps=None if ref is None else ref[w].to(sums.dtype),
        chosen_lengths=lengths[b], rejected_lengths=lengths[w],
    )


def pair_losses(policy, batch: Batch, *, reference, objective: Objective, backend: str, chunk_size: int = 1024,
                item=None, context=None) -> PairStep:
    """Per-pair losses [P] of one micro-batch.

    context: the optimizer step's context for losses coupled across pairs (sft, aot, bco_pair; see
             `prefixdpo.objective`), restricted to this micro-batch's pairs; or a function building it from
             this batch's PairLogps (evaluation); None when the batch is the whole step (the benchmark).
    """
    pairs = pair_logps(policy, batch, reference=reference, backend=backend, chunk_size=chunk_size, item=item)
    if callable(context):
        context = context(pairs)
    losses, _ = combined_loss(list(objective.loss_types), list(objective.loss_weights), pairs, objective.params,
                              context=context)
    return PairStep(losses=losses, pairs=pairs)
