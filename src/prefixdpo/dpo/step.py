"""One micro-batch of preference training as one pure function: policy log-probs, reference log-probs,
per-pair losses and their metric sums. The trainer and the benchmark both call `pair_losses`, so what is
benchmarked is what trains.

    batch --mask--> policy log-prob sums [R] (grad follows torch.is_grad_enabled())
          --reference strategy--> reference sums [R] (no grad; None for reference-free losses)
          --pairs (better, worse)--> PairLogps [P] --objective--> losses [P]

TRL's options on this path: `ld_alpha` (LD-DPO) re-weights each pair's log-probs from the per-token
log-probs of both passes; `use_weighting` (WPO) takes its weights from the policy's head pass; a MoE
policy's load-balancing loss comes back as `PairStep.aux_loss` for the trainer to add. The caller builds the
batch's mask once (one per micro-batch, for the run's backend) and passes it to every pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixdpo.data.batch import Batch
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.logprobs import ResponseLogps, ld_pair_logps
from prefixdpo.dpo.objective import LossParams, PairLogps, combined_loss
from prefixdpo.dpo.metrics import pair_metric_sums


@dataclass(frozen=True)
class Objective:
    """What the losses are: TRL's `loss_type` list, its weights, the shared hyper-parameters, and the MoE
    load-balancing coefficient (`forward.resolve_router_aux_loss_coef`; 0.0: no aux loss computed)."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] = (1.0,)
    params: LossParams = field(default_factory=LossParams)
    router_aux_loss_coef: float = 0.0


@dataclass
class PairStep:
    """The result of one micro-batch. losses: [P]; pairs: the per-pair log-probs they were computed from;
    aux_loss: the policy's MoE load-balancing loss of this micro-batch (scalar, unweighted), or None."""

    losses: torch.Tensor
    pairs: PairLogps
    aux_loss: torch.Tensor | None = None

    def metric_sums(self, beta: float) -> dict[str, float]:
        p = self.pairs
        return pair_metric_sums(p.policy_chosen_logps, p.policy_rejected_logps, p.ref_chosen_logps,
                                p.ref_rejected_logps, p.chosen_lengths, p.rejected_lengths, beta)


def pair_logps(policy, batch: Batch, mask, *, reference, chunk_size: int = 1024, item=None, ref_logps=None,
               params: LossParams | None = None) -> PairLogps:
    """Per-pair log-prob sums [P] of `batch` under the policy and the reference.

    mask: the batch's attention mask, one for both passes. reference: a `reference.Reference`; item: the loader's
    `MicroBatch` (a precomputed reference's rows are read from it by the reference). ref_logps: [R] the
    reference's sums when this step already has them (its pre-pass), used instead of running the reference
    again. `params.ld_alpha` and `params.use_weighting` change the sums / add WPO's weights as TRL 1.16 does
    (defaults: neither).
    """
    return _pair_logps(policy, batch, mask, reference=reference, chunk_size=chunk_size, item=item,
                       ref_logps=ref_logps, params=params)[0]


def _pair_logps(policy, batch: Batch, mask, *, reference, chunk_size: int, item, ref_logps,
                params: LossParams | None, router_aux: bool = False) -> tuple[PairLogps, torch.Tensor | None]:
    """`pair_logps`, and the policy's MoE load-balancing loss when `router_aux` (else None)."""
    params = params or LossParams()
    ld_alpha = params.ld_alpha
    policy_logps = compute_response_logps(policy, batch, mask, chunk_size=chunk_size, wpo=params.use_weighting,
                                          router_aux=router_aux)
    b, w = batch.pair_better, batch.pair_worse
    if ld_alpha is None:
        ref = ref_logps.to(batch.input_ids.device) if ref_logps is not None else reference.sums(
            policy, batch, mask, item)
        chosen, rejected = policy_logps.sums[b], policy_logps.sums[w]
        ref_chosen = ref_rejected = None
        if ref is not None:
            ref_chosen, ref_rejected = ref[b].to(chosen.dtype), ref[w].to(chosen.dtype)
    else:
        chosen, rejected = _ld(policy_logps, batch, ld_alpha)
        ref_chosen = ref_rejected = None
        ref_tokens = reference.token_logps(policy, batch, mask)
        if ref_tokens is not None:
            ref_chosen, ref_rejected = (x.to(chosen.dtype) for x in _ld(ref_tokens, batch, ld_alpha))
    lengths = policy_logps.counts.to(policy_logps.sums.dtype)
    weights = None
    if params.use_weighting:
        # TRL: w = exp(mean aligned log-prob over the response's tokens, at least one token)
        response_weights = torch.exp(policy_logps.wpo_sums / lengths.clamp(min=1))
        weights = response_weights[b] * response_weights[w]
    pairs = PairLogps(
        policy_chosen_logps=chosen, policy_rejected_logps=rejected,
        ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
        chosen_lengths=lengths[b], rejected_lengths=lengths[w], wpo_weights=weights,
    )
    return pairs, policy_logps.aux_loss


def _ld(logps: ResponseLogps, batch: Batch, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ld_pair_logps(logps.per_token, batch.target_response, logps.counts, batch.pair_better, batch.pair_worse,
                         alpha)


def pair_losses(policy, batch: Batch, mask, *, reference, objective: Objective, chunk_size: int = 1024,
                item=None, ref_logps=None, context=None) -> PairStep:
    """Per-pair losses [P] of one micro-batch (mask, item, ref_logps: see `pair_logps`).

    context: the optimizer step's context for losses coupled across pairs (sft, aot, bco_pair; see
             `prefixdpo.dpo.objective`), restricted to this micro-batch's pairs; or a function building it from
             this batch's PairLogps (evaluation); None when the batch is the whole step (the benchmark).
    """
    pairs, aux_loss = _pair_logps(policy, batch, mask, reference=reference, chunk_size=chunk_size, item=item,
                                  ref_logps=ref_logps, params=objective.params,
                                  router_aux=objective.router_aux_loss_coef != 0.0)
    if callable(context):
        context = context(pairs)
    losses, _ = combined_loss(list(objective.loss_types), list(objective.loss_weights), pairs, objective.params,
                              context=context)
    return PairStep(losses=losses, pairs=pairs, aux_loss=aux_loss)


def zero_weight_loss(policy, batch: Batch, mask, *, reference, objective: Objective, chunk_size: int = 1024,
                     ref_logps=None) -> torch.Tensor:
    """A scalar 0 with a gradient path to every parameter a pass reaches: what a rank-balancing empty micro-batch
    trains (or evaluates) while other ranks run `pair_losses`. It runs their passes in their order (the policy's,
    then the reference's unless `ref_logps` is given), on a line with responses and no pair (`loader.stand_in_batch`),
    asking `reference` (a `reference.IdleReference`, whose answers are zeros), so every engine's collectives line up
    on every rank: DDP's buffer broadcast at each call of its wrapper, FSDP2's and ZeRO-3's per-module gathers.
    """
    pairs, aux_loss = _pair_logps(policy, batch, mask, reference=reference, chunk_size=chunk_size, item=None,
                                  ref_logps=ref_logps, params=objective.params,
                                  router_aux=objective.router_aux_loss_coef != 0.0)
    loss = (pairs.policy_chosen_logps.sum() + pairs.policy_rejected_logps.sum()) * 0.0
    return loss if aux_loss is None else loss + aux_loss * 0.0
