"""One DPO micro-batch, from the loader to the loss Trainer runs backward on: the whole path in this file, the loss
table beside it (`loss_table.py`: one row per loss; `losses.py`: the pure functions).

    the loader           `data.loader.MicroBatches` (built by `training.base.get_train_dataloader`) plans each
                         epoch's micro-batches, padded or packed lines, the same number on every rank; each item
                         is one `MicroBatch` (a `Batch` of lines and its pairs, and the step's pair count)
    transformers.Trainer._inner_training_loop, per optimizer step (the trainer's hooks, each calling its `DPOStep`):
      get_batch_samples    the step's micro-batches, all in hand before the first forward
        in_step            each as a `StepInputs`; losses coupled across the step's pairs (sft, aot, bco_pair) get
                           their slice of the step's context (`coupling.py`), from a no-grad `prepass` where they
                           need every pair's log-probs (its mask and reference sums are kept for the training pass)
      training_step -> compute_loss (`training.base`) -> _compute_loss, per micro-batch:
        pair_step          the micro-batch on the device with ONE attention mask for every pass over it; then
          pair_losses        1. policy pass: per-response log-prob sums [R] (grad; `core.forward`)
                             2. reference pass: sums [R] (no grad; a `reference.Reference`, or the pre-pass's)
                             3. pair log-probs [P] (LD-DPO's split, WPO's weights: `token_weights.py`)
                             4. combined loss [P]: the configured rows of the loss table, weighted
                           and the micro-batch's metric sums (TRL's names, `PairStep.metric_sums`)
        loss               sum(pair losses) x W / N, N the step's pairs over all W ranks (`_step_share`), plus the
                           MoE load-balancing loss as TRL weighs it
      Trainer: loss.backward(); after the step's last micro-batch, the optimizer step.

The benchmark runs `pair_losses` too (`bench/step.py`), so what is benchmarked is what trains. An empty micro-batch
(no pair, rank balancing) runs a real one's passes at zero weight (`zero_weight_loss`), so every rank joins the same
collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from prefixdpo.core.stock_attention import plan_run_pass
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.logprobs import ResponseLogps
from prefixdpo.core.moe import resolve_router_aux_loss_coef
from prefixdpo.data.batch import Batch
from prefixdpo.data.loader import MicroBatch, stand_in_batch
from prefixdpo.dpo.coupling import StepContext, StepCoupling, build_step_context
from prefixdpo.dpo.loss_table import (
    LOSS_TABLE, LossParams, LossRow, PairLogps, check_loss_options, loss_row, needs_step_pairs, resolve_losses,
)
from prefixdpo.dpo.losses import rewards
from prefixdpo.dpo.reference import IdleReference
from prefixdpo.dpo.token_weights import ld_pair_logps, wpo_aligned_logps, wpo_pair_weights
from prefixdpo.training.metrics import COUNTS, MetricSums

__all__ = ["Objective", "StepInputs", "PairStep", "DPOMetricSums", "DPOStep", "pair_losses", "pair_logps",
           "zero_weight_loss", "combined_loss"]


@dataclass(frozen=True)
class Objective:
    """The loss settings of a run: TRL's `loss_type` list, its weights, the loss options, and the MoE
    load-balancing coefficient (`moe.resolve_router_aux_loss_coef`; 0.0: no aux loss computed)."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] = (1.0,)
    params: LossParams = field(default_factory=LossParams)
    router_aux_loss_coef: float = 0.0

    @classmethod
    def from_config(cls, config, policy) -> Objective:
        """The objective `config` (a `PrefixDPOConfig`) asks of `policy` (RPO's NLL term included)."""
        return cls(tuple(config.loss_types), tuple(config.loss_weight_list), LossParams.from_config(config),
                   resolve_router_aux_loss_coef(policy, config.router_aux_loss_coef))


@dataclass(frozen=True)
class StepInputs:
    """One micro-batch as an optimizer step hands it to `compute_loss`: the loader's MicroBatch, unchanged, and
    what the step worked out for it beside it.

    micro:     the loader's `MicroBatch`
    context:   its slice of the step context (losses coupled across the step's pairs), or None; in evaluation,
               a function of the batch's PairLogps (`StepCoupling.for_evaluation`)
    batch:     `micro.batch` on the device, and mask: its attention mask for the run's backend: built once (by
               the pre-pass, or by `on_device` before the training pass) for every pass over the micro-batch.
               A rank-balancing empty micro-batch (`idle`: no pair) gets a stand-in line instead
               (`loader.stand_in_batch`), whose passes it runs at zero weight
    ref_logps: [R] the reference's log-prob sums the pre-pass read (run, or a precomputed table's rows), or None
               (no pre-pass: the training pass asks the reference)
    """

    micro: MicroBatch
    context: Any = None
    batch: Batch | None = None
    mask: Any = None
    ref_logps: Tensor | None = None

    @property
    def idle(self) -> bool:
        """A rank-balancing empty micro-batch: it runs a real one's passes at zero weight."""
        return self.micro.batch.num_pairs == 0

    def on_device(self, device, backend: str, pad_token_id: int, tokens_per_pass: int | None = None,
                  pad_multiple: int = 1) -> StepInputs:
        """This micro-batch with its Batch (an idle one's stand-in line, `pad_multiple` columns long at least) on
        `device` and its attention mask (kept if already built; a `PrefixReuse` plan for a line over
        `tokens_per_pass`)."""
        if self.batch is not None:
            return self
        batch = (stand_in_batch(pad_token_id, pad_multiple) if self.idle else self.micro.batch).to(device)
        mask = plan_run_pass(batch, backend, max_tokens_per_pass=tokens_per_pass)
        return replace(self, batch=batch, mask=mask)


@dataclass
class PairStep:
    """The result of one micro-batch. losses: [P]; pairs: the per-pair log-probs they were computed from;
    aux_loss: the policy's MoE load-balancing loss of this micro-batch (scalar, unweighted), or None."""

    losses: Tensor
    pairs: PairLogps
    aux_loss: Tensor | None = None

    def metric_sums(self, beta: float) -> dict[str, float]:
        """Sums over the pairs of TRL's per-pair metrics (`PAIR_METRICS`; rewards as TRL computes them, length-
        normalised without a reference). One `.tolist()` for all six: each `.item()` would be a device sync on GPU."""
        p = self.pairs
        r_c = rewards(p.policy_chosen_logps, p.ref_chosen_logps, beta, p.chosen_lengths).detach()
        r_r = rewards(p.policy_rejected_logps, p.ref_rejected_logps, beta, p.rejected_lengths).detach()
        sums = torch.stack([
            r_c.sum(), r_r.sum(), (r_c - r_r).sum(), (r_c > r_r).to(r_c.dtype).sum(),
            p.policy_chosen_logps.detach().sum(), p.policy_rejected_logps.detach().sum(),
        ]).tolist()
        return dict(zip(PAIR_METRICS, sums))


class DPOStep:
    """`PrefixDPOTrainer`'s step: what the Trainer hooks of one optimizer step run, in the order they run it (module
    docstring), built once per run with everything it reads (`of_run`); the trainer calls it from its hooks.

    objective: the loss settings; coupling: the step's coupling across pairs (`coupling.StepCoupling`); reference: the
    run's `reference.Reference`; sharing: the run's `training.sharing_run.SharingRun` (the pass backend, prefix
    reuse's budget); device, pad_token_id, pad_multiple (an idle micro-batch's stand-in line), chunk_size (the
    log-prob chunk of a pass).
    """

    def __init__(self, objective: Objective, coupling: StepCoupling, reference, sharing, *, device, pad_token_id: int,
                 pad_multiple: int, chunk_size: int):
        self.objective, self.coupling, self.reference, self.sharing = objective, coupling, reference, sharing
        self.device, self.pad_token_id, self.pad_multiple = device, pad_token_id, pad_multiple
        self.chunk_size = chunk_size
        self.idle_reference = IdleReference(reference)  # what an idle micro-batch asks (`StepInputs.idle`)

    @classmethod
    def of_run(cls, config, policy, *, reference, sharing, accelerator, pad_token_id: int,
               pad_multiple: int) -> DPOStep:
        """The step `config` (a `PrefixDPOConfig`) asks of `policy`, its coupling over `accelerator`'s ranks."""
        objective = Objective.from_config(config, policy)
        return cls(objective, StepCoupling(objective, accelerator, sharing.sp_size), reference, sharing,
                   device=config.device, pad_token_id=pad_token_id, pad_multiple=pad_multiple,
                   chunk_size=config.logprob_chunk_size)

    # ---- the optimizer step: its micro-batches, and what the coupled losses need of them all --------------------

    def in_step(self, policy, micro_batches: list[MicroBatch]) -> list[StepInputs]:
        """Each micro-batch of an optimizer step with what the step works out for it: its slice of the step
        context and, where the coupled losses need every pair's log-probs first, the pre-pass's results."""
        steps = [StepInputs(micro) for micro in micro_batches]
        if not self.coupling.enabled:
            return steps
        pairs = [None] * len(steps)
        if self.coupling.needs_pairs:  # an idle micro-batch too: its passes join the other ranks' collectives
            for i, micro in enumerate(micro_batches):
                steps[i], pairs[i] = self.prepass(policy, micro)
        contexts = self.coupling.contexts(micro_batches, pairs)
        return [replace(step, context=context) for step, context in zip(steps, contexts)]

    def prepass(self, policy, micro: MicroBatch) -> tuple[StepInputs, PairLogps]:
        """No-grad per-pair log-probs of one micro-batch, for the step context. Its batch on the device, its mask
        and the reference's sums are kept beside the micro-batch, so the training pass builds no second mask and
        runs no second reference pass (LD-DPO needs the reference's tokens: it reruns the reference)."""
        step = self.on_device(StepInputs(micro))
        reference = self.reference_of(step)
        with torch.no_grad():
            if self.objective.params.ld_alpha is None:
                step = replace(step, ref_logps=reference.sums(policy, step.batch, step.mask, micro))
            pairs = pair_logps(policy, step.batch, step.mask, reference=reference, chunk_size=self.chunk_size,
                               item=micro, ref_logps=step.ref_logps, params=self.objective.params)
        return step, pairs

    def on_device(self, step: StepInputs) -> StepInputs:
        return step.on_device(self.device, self.sharing.backend, self.pad_token_id, self.sharing.tokens_per_pass,
                              self.pad_multiple)

    def reference_of(self, step: StepInputs):
        """The reference `step`'s passes ask: the run's, or, for an idle micro-batch, the run's at zero weight."""
        return self.idle_reference if step.idle else self.reference

    # ---- one micro-batch ------------------------------------------------------------------------------------------

    def loss(self, result: PairStep | None, idle_loss, share: float, accumulation_steps: int) -> Tensor:
        """The loss Trainer runs backward on: the micro-batch's share of the step's mean pair loss (`share`: W / N,
        `training.base._step_share`); a rank-balancing empty slot's `idle_loss`."""
        if result is None:
            return idle_loss
        # x num_processes: DDP/FSDP/DeepSpeed average gradients over ranks, while we want the sum over
        # ranks of (pair losses / all pairs of the step)
        loss = result.losses.sum() * share
        if result.aux_loss is not None:
            # as TRL: coef x aux per micro-batch, averaged over accumulation steps and (by DDP) over ranks
            loss = loss + self.objective.router_aux_loss_coef * result.aux_loss / accumulation_steps
        return loss

    def pair_step(self, policy, inputs: StepInputs | MicroBatch, split: str, sums: MetricSums):
        """(the micro-batch's PairStep, None), or, for a rank-balancing empty micro-batch, (None, its zero-weight
        loss), for which it ran a real micro-batch's passes (`zero_weight_loss`); adds its metric sums to `sums`.
        Training passes StepInputs (`in_step`), evaluation the loader's MicroBatch (an empty one runs the passes
        too, under evaluation's no_grad: every rank joins the same collectives)."""
        if split == "train":
            step = inputs
        else:
            step = StepInputs(inputs, context=self.coupling.for_evaluation if self.coupling.enabled else None)
        step = self.on_device(step)
        batch = step.batch
        if step.idle:
            return None, zero_weight_loss(policy, batch, step.mask, reference=self.idle_reference,
                                          objective=self.objective, chunk_size=self.chunk_size,
                                          ref_logps=step.ref_logps)
        result = pair_losses(policy, batch, step.mask, reference=self.reference, objective=self.objective,
                             chunk_size=self.chunk_size, item=step.micro, ref_logps=step.ref_logps,
                             context=step.context)
        stats = result.metric_sums(self.objective.params.beta)
        loss_sum = result.losses.detach().sum().item()
        if result.aux_loss is not None:  # TRL's logged loss includes the weighted aux loss
            loss_sum += self.objective.router_aux_loss_coef * float(result.aux_loss.detach()) * batch.num_pairs
        stats.update(pairs=batch.num_pairs, loss_sum=loss_sum, **step.micro.token_counts())
        sums.add(stats)
        return result, None


# ---- the micro-batch's passes and losses, as pure functions ----------------------------------------------------------


def pair_losses(policy, batch: Batch, mask, *, reference, objective: Objective, chunk_size: int = 1024,
                item=None, ref_logps=None, context=None) -> PairStep:
    """Per-pair losses [P] of one micro-batch (mask, item, ref_logps: see `pair_logps`).

    context: the optimizer step's context for losses coupled across pairs (sft, aot, bco_pair; see
             `prefixdpo.dpo.coupling`), restricted to this micro-batch's pairs; or a function building it from
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
                     ref_logps=None) -> Tensor:
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
                params: LossParams | None, router_aux: bool = False) -> tuple[PairLogps, Tensor | None]:
    """`pair_logps`, and the policy's MoE load-balancing loss when `router_aux` (else None)."""
    params = params or LossParams()
    b, w = batch.pair_better, batch.pair_worse
    # 1. the policy's pass; WPO's aligned log-probs are a statistic of its own head pass
    policy_logps = compute_response_logps(policy, batch, mask, chunk_size=chunk_size, router_aux=router_aux,
                                          stat=wpo_aligned_logps if params.use_weighting else None)
    # 2. the reference's: per-response sums (the pre-pass's when given), or, for LD-DPO, per-token log-probs
    if params.ld_alpha is None:
        ref = ref_logps.to(batch.input_ids.device) if ref_logps is not None else reference.sums(
            policy, batch, mask, item)
        chosen, rejected = policy_logps.sums[b], policy_logps.sums[w]
        ref_pair = None if ref is None else (ref[b], ref[w])
    else:
        chosen, rejected = _ld_split(policy_logps, batch, params.ld_alpha)
        ref_tokens = reference.token_logps(policy, batch, mask)
        ref_pair = None if ref_tokens is None else _ld_split(ref_tokens, batch, params.ld_alpha)
    ref_chosen, ref_rejected = (None, None) if ref_pair is None else (x.to(chosen.dtype) for x in ref_pair)
    # 3. the pairs: better / worse rows of the responses
    lengths = policy_logps.counts.to(policy_logps.sums.dtype)
    pairs = PairLogps(
        policy_chosen_logps=chosen, policy_rejected_logps=rejected,
        ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
        chosen_lengths=lengths[b], rejected_lengths=lengths[w],
        wpo_weights=wpo_pair_weights(policy_logps.stat_sums, policy_logps.counts, b, w) if params.use_weighting
        else None,
    )
    return pairs, policy_logps.aux_loss


def _ld_split(logps: ResponseLogps, batch: Batch, alpha: float) -> tuple[Tensor, Tensor]:
    return ld_pair_logps(logps.per_token, batch.target_response, logps.counts, batch.pair_better, batch.pair_worse,
                         alpha)


# ---- 4. the combined loss: the configured rows of the loss table -----------------------------------------------------


def combined_loss(
    loss_types: list[str] | str,
    loss_weights: list[float] | None,
    inputs: PairLogps,
    params: LossParams | None = None,
    context: StepContext | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted sum of the losses per pair (TRL's ``loss_type`` list + ``loss_weights``), ``[P]``, and each
    loss's per-pair values before its weight (after WPO's pair weight), ``{name: [P]}``.

    ``context``: this call's slice of its step (``build_step_context(...).local(indices)``); ``None``: ``inputs``
    are the whole step. Summed over the step's pairs and divided by ``P_step``, the total is TRL 1.16's loss on
    one batch of those pairs, in value and gradients (for the sorted AOT losses an entry is the pair's share).
    """
    params = params or LossParams()
    losses = resolve_losses(loss_types, loss_weights)
    names = [name for name, _ in losses]
    check_loss_options(names, params)
    for name in names:
        _check_inputs(name, loss_row(name), inputs, params)
    context = _checked_context(context, names, inputs, params)

    total = torch.zeros_like(inputs.policy_chosen_logps)
    per_type: dict[str, Tensor] = {}
    for name, weight in losses:
        row = loss_row(name)
        loss = row.compute(inputs, row.read_options(params), context.for_loss(name))
        if params.use_weighting:
            loss = loss * inputs.wpo_weights
        per_type[name] = loss
        total = total + weight * loss
    return total, per_type


def _check_inputs(name: str, row: LossRow, inputs: PairLogps, params: LossParams) -> None:
    # The trainer supplies what the configured losses need: a missing input is its bug (ValueError).
    if row.reference and not inputs.has_reference:
        free = sorted(n for n, r in LOSS_TABLE.items() if not r.reference)
        raise ValueError(f"loss {name!r} needs reference log-probs (ref_chosen_logps and ref_rejected_logps); "
                         f"losses without a reference: {', '.join(free)}")
    for attr in row.lengths:
        if getattr(inputs, attr) is None:
            raise ValueError(f"loss {name!r} needs {attr} (response token counts)")
    if params.use_weighting and inputs.wpo_weights is None:
        raise ValueError("use_weighting needs wpo_weights (pair_logps(..., params) computes them)")


def _checked_context(context, names: list[str], inputs: PairLogps, params: LossParams) -> StepContext:
    """`context`, checked against `inputs`; for None, the context of `inputs` as the whole step (running means
    read as 0, as TRL 1.16's BCO)."""
    if context is None:
        lengths = inputs.chosen_lengths
        return build_step_context(
            names, params, inputs.for_step() if needs_step_pairs(names, train=False) else None,
            num_pairs=inputs.num_pairs,
            # a tensor in the log-probs' dtype: no host sync, no float32 rounding of the mean length
            chosen_tokens=None if lengths is None else lengths.to(inputs.policy_chosen_logps.dtype).sum(),
            running=None, train=False,
        )  # fmt: skip
    if not isinstance(context, StepContext):
        raise TypeError(
            f"context must be a StepContext (from build_step_context(...).local(indices)), got {type(context).__name__}"
        )
    held = context.pairs_held()
    if held is not None and held != inputs.num_pairs:
        raise ValueError(f"context holds {held} pairs but inputs hold {inputs.num_pairs}: pass context.local(indices) "
                         "of this micro-batch")
    return context


# ---- the metric sums: TRL's names, summed per pair, logged as means ------------------------------------------------

PAIR_METRICS = (
    "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected",
)


class DPOMetricSums(MetricSums):
    """DPO's per-pair sums between two logs, logged as means per pair (`training.metrics`), reduced over ranks."""

    KEYS = PAIR_METRICS + COUNTS

    def means(self, totals: dict[str, float], accelerator=None) -> dict[str, float]:
        pairs = max(totals["pairs"], 1.0)
        return {k: totals[k] / pairs for k in PAIR_METRICS}
