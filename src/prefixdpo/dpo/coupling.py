"""The optimizer step's coupling: what losses coupled across pairs need of the whole step (their rows in
`prefixdpo.dpo.loss_table` say what: the step's chosen tokens, its pairs' detached log-probs, a running mean),
as one `StepContext` per step, built by `build_step_context`.

Every loss is defined on the pairs of one whole optimizer step (all micro-batches, all ranks), as TRL 1.16
computes it on one batch: the step's loss is ``sum(per-pair losses) / P_step`` however the pairs are split,
in value and gradients.

Trainer hands the step all micro-batches of one optimizer step before the first forward
(`step.DPOStep.in_step`). `StepCoupling` collects what the coupled losses need over the step's
pairs on every rank, builds the step's context once, and gives each micro-batch its slice (beside it, in
`step.StepInputs`), so packing, gradient accumulation and world size cannot change the loss:

- sft / orpo / RPO need the step's chosen-token total: from the data, no forward;
- aot, aot_unpaired and training bco_pair need every pair's detached log-probs: one no-grad pre-pass over
  this rank's micro-batches, gathered over ranks. Its reference sums (and each micro-batch's mask) are kept for
  the training pass, so the extra cost is one no-grad policy forward per micro-batch.

Pairs are numbered rank by rank, then micro-batch by micro-batch, then in batch order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from prefixdpo.data.loader import MicroBatch
from prefixdpo.dpo.loss_table import (
    LossParams, LossRow, LossStep, PairLogps, canonical_loss_types, coupled, loss_row, needs_step_pairs, resolve_losses,
)

__all__ = ["RunningMean", "StepContext", "build_step_context", "StepCoupling"]


@dataclass
class RunningMean:
    """Running mean of values over training steps (BCO's ``delta``, https://arxiv.org/abs/2404.04656).

    Count-weighted over every value seen. :func:`build_step_context` folds in each training step's values
    once, over all its pairs on all ranks (every rank keeps the same mean), BEFORE the step's losses read it,
    as the BCO paper's Algorithm 1 and TRL < 1.0 do. Evaluation reads it and never moves it; it is saved
    with checkpoints (:meth:`state_dict`).
    """

    mean: float = 0.0
    count: int = 0

    def update(self, values: Tensor) -> float:
        """Fold ``values`` (any shape, detached here) into the mean; return the new mean."""
        values = values.detach().double().flatten()
        n = values.numel()
        if n:
            total = self.count + n
            self.mean += (values.mean().item() - self.mean) * n / total
            self.count = total
        return self.mean

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.count = float(state["mean"]), int(state["count"])


@dataclass(frozen=True)
class StepContext:
    """What the configured losses need of the whole optimizer step; build with :func:`build_step_context`.

    - ``num_pairs``: pairs in the whole step, the divisor of the summed per-pair losses.
    - ``mean_chosen_tokens``: the step's chosen tokens / ``num_pairs`` (rows with ``token_mean``).
    - ``step_values``: loss name -> its row's ``step_values``, each ``[P_step]``, or ``[P_local]`` after :meth:`local`.
    - ``running_means``: loss name -> its running mean for this step (rows with ``running_mean``).
    """

    num_pairs: int
    mean_chosen_tokens: Tensor | float = 1.0
    step_values: Mapping[str, tuple[Tensor, ...]] = field(default_factory=dict)
    running_means: Mapping[str, float] = field(default_factory=dict)

    def local(self, indices: Tensor) -> StepContext:
        """The context of one micro-batch whose pairs have step indices ``indices`` ``[P_local]``."""
        picked = {name: tuple(t[indices.to(t.device)] for t in values) for name, values in self.step_values.items()}
        return replace(self, step_values=picked)

    def pairs_held(self) -> int | None:
        """Pairs the per-pair values hold (``P_step``, or ``P_local`` after :meth:`local`); None if none."""
        for values in self.step_values.values():
            return values[0].numel()
        return None

    def for_loss(self, name: str) -> LossStep:
        return LossStep(self.mean_chosen_tokens, self.step_values.get(name), self.running_means.get(name, 0.0))


def build_step_context(
    loss_types: Iterable[str] | str,
    params: LossParams,
    step_pairs: PairLogps | None,
    *,
    num_pairs: int,
    chosen_tokens: Tensor | float | None,
    running: Mapping[str, RunningMean] | None,
    train: bool,
) -> StepContext:
    """The :class:`StepContext` of one optimizer step (or one evaluation batch), from the losses' rows.

    ``step_pairs``: every pair of the step (:meth:`~prefixdpo.dpo.loss_table.PairLogps.for_step`) where
    :func:`~prefixdpo.dpo.loss_table.needs_step_pairs` says so;
    ``num_pairs``: the step's pairs (all micro-batches, all ranks); ``chosen_tokens``: the step's chosen
    tokens (counted as at least one, like TRL's clamp); ``running``: loss name -> its running mean, updated
    here with the step's values when ``train`` (a loss without one reads 0.0, as TRL 1.16's BCO).
    """
    rows = {name: loss_row(name) for name, _ in resolve_losses(loss_types)}
    running = running or {}
    # A running mean without its state has nothing to update: then the step's pairs are needed as in evaluation.
    # These arguments come from the trainer, not from an option: a wrong one is a bug (ValueError, traceback).
    pair_users = sorted(n for n, row in rows.items() if row.needs_step_pairs(train=train and n in running))
    if step_pairs is None and pair_users:
        raise ValueError(
            f"losses {', '.join(pair_users)} need step_pairs (detached log-probs of every pair of the step)"
        )
    if step_pairs is not None and step_pairs.num_pairs != num_pairs:
        raise ValueError(f"step_pairs holds {step_pairs.num_pairs} pairs but num_pairs={num_pairs}")

    mean_chosen_tokens = _mean_chosen_tokens(rows, num_pairs, chosen_tokens)  # checked before any state moves
    values = {name: row.step_values(step_pairs) for name, row in rows.items() if row.step_values}
    return StepContext(num_pairs, mean_chosen_tokens, values, _running_means(rows, params, step_pairs, running, train))


def _mean_chosen_tokens(rows: dict[str, LossRow], num_pairs: int, chosen_tokens: Tensor | float | None
                        ) -> Tensor | float:
    """The step's chosen tokens per pair where a row has ``token_mean`` (else 1.0, unread)."""
    token_users = sorted(n for n, row in rows.items() if row.token_mean)
    if not token_users:
        return 1.0
    if chosen_tokens is None:
        raise ValueError(f"losses {', '.join(token_users)} need chosen_tokens of the step")
    total = chosen_tokens.clamp(min=1) if isinstance(chosen_tokens, Tensor) else max(chosen_tokens, 1)
    return total / max(num_pairs, 1)


def _running_means(rows: dict[str, LossRow], params: LossParams, step_pairs: PairLogps | None,
                   running: Mapping[str, RunningMean], train: bool) -> dict[str, float]:
    """Each running mean of these losses, after folding in the step's values when ``train``."""
    means = {}
    for name, row in rows.items():
        if row.running_mean and name in running:
            if train:
                running[name].update(row.running_mean(step_pairs, row.read_options(params)))
            means[name] = running[name].mean
    return means


class StepCoupling:
    """Builds each micro-batch's slice of the step's context; owns the losses' running means (saved in
    checkpoints)."""

    def __init__(self, objective, accelerator, sp_size: int = 1):
        self.objective = objective
        self.accelerator = accelerator
        self.sp_size = sp_size  # ranks per sequence-parallel group (consecutive ranks)
        self.names = canonical_loss_types(objective.loss_types)
        self.enabled = coupled(self.names)
        self.needs_pairs = needs_step_pairs(self.names, train=True)
        self.running = {name: RunningMean() for name in self.names if loss_row(name).running_mean}

    def contexts(self, samples: list[MicroBatch], prepassed: list[PairLogps | None]) -> list:
        """Each micro-batch's slice of the step context (`samples`: the step's micro-batches on this rank).

        prepassed: per micro-batch, its detached PairLogps from the pre-pass (where `needs_pairs` and it has pairs).
        """
        if not self.enabled or not samples:
            return [None] * len(samples)
        rows, counts = [], []  # per pair: chosen tokens[, policy c, policy r, ref c, ref r]
        for item, p in zip(samples, prepassed):
            batch = item.batch
            cols = [batch.response_lengths[batch.pair_better].double()]
            if self.needs_pairs and batch.num_pairs:
                cols += [t.detach().double().cpu() for t in (p.policy_chosen_logps, p.policy_rejected_logps,
                                                              p.ref_chosen_logps, p.ref_rejected_logps)]
            width = 5 if self.needs_pairs else 1
            rows.append(torch.stack(cols, dim=1) if batch.num_pairs else torch.zeros(0, width, dtype=torch.float64))
            counts.append(batch.num_pairs)
        # one [P_rank, width] tensor per rank, in rank order; a sequence-parallel group's ranks hold the same pairs:
        # its first rank's count
        everyone = self._gather(torch.cat(rows))[:: self.sp_size]
        offset = sum(int(t.shape[0]) for t in everyone[: self.accelerator.process_index // self.sp_size])
        step = torch.cat(everyone)
        planned = samples[0].step_pairs
        if step.shape[0] != planned:
            raise RuntimeError(f"step context: gathered {step.shape[0]} pairs, the plan says {planned}")
        pairs = PairLogps(*step[:, 1:5].unbind(1)) if self.needs_pairs else None
        context = build_step_context(self.names, self.objective.params, pairs, num_pairs=planned,
                                     chosen_tokens=float(step[:, 0].sum()), running=self.running, train=True)
        slices = []
        for n in counts:
            slices.append(context.local(torch.arange(offset, offset + n)))
            offset += n
        return slices

    def for_evaluation(self, inputs):
        """Context of one evaluation micro-batch (its own pairs; running means are read, never moved)."""
        pairs = inputs.for_step() if needs_step_pairs(self.names, train=False) else None
        return build_step_context(self.names, self.objective.params, pairs, num_pairs=inputs.num_pairs,
                                  chosen_tokens=inputs.chosen_lengths.sum(), running=self.running, train=False)

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.accelerator.num_processes == 1:
            return [t]
        from accelerate.utils import gather_object

        width = t.shape[1]
        return [torch.tensor(part, dtype=torch.float64).reshape(-1, width) for part in gather_object([t.tolist()])]

    def state_dict(self) -> dict:
        return {"running_means": {name: mean.state_dict() for name, mean in self.running.items()}}

    def load_state_dict(self, state: dict) -> None:
        saved = dict(state.get("running_means", {}))
        if "bco_running_mean" in state:  # a checkpoint written before the loss table
            saved.setdefault("bco_pair", state["bco_running_mean"])
        for name, mean in self.running.items():
            if name in saved:
                mean.load_state_dict(saved[name])
