"""The training objective: ``combined_loss`` (the weighted per-pair losses of one call) and the
:class:`StepContext` that losses coupled across pairs read, built once per optimizer step.

Every loss is defined on the pairs of one whole optimizer step (all micro-batches, all ranks), as TRL 1.16
computes it on one batch: the step's loss is ``sum(per-pair losses) / P_step`` however the pairs are split,
in value and gradients. What a loss needs of the step is declared in its row of
:mod:`prefixdpo.dpo.loss_table`; the trainer's side (pre-pass, gather over ranks) is :mod:`prefixdpo.dpo.coupling`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from prefixdpo.dpo.loss_table import (
    LOSS_TABLE,
    LossParams,
    LossRow,
    LossStep,
    PairLogps,
    StepPairs,
    check_loss_options,
    loss_row,
    needs_step_pairs,
    resolve_losses,
)
from prefixdpo.dpo.losses import LossConfigError

__all__ = ["RunningMean", "StepContext", "build_step_context", "combined_loss", "LossConfigError"]


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
    step_pairs: StepPairs | None,
    *,
    num_pairs: int,
    chosen_tokens: Tensor | float | None,
    running: Mapping[str, RunningMean] | None,
    train: bool,
) -> StepContext:
    """The :class:`StepContext` of one optimizer step (or one evaluation batch), from the losses' rows.

    ``step_pairs``: every pair of the step where :func:`~prefixdpo.dpo.loss_table.needs_step_pairs` says so;
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


def _running_means(rows: dict[str, LossRow], params: LossParams, step_pairs: StepPairs | None,
                   running: Mapping[str, RunningMean], train: bool) -> dict[str, float]:
    """Each running mean of these losses, after folding in the step's values when ``train``."""
    means = {}
    for name, row in rows.items():
        if row.running_mean and name in running:
            if train:
                running[name].update(row.running_mean(step_pairs, row.read_options(params)))
            means[name] = running[name].mean
    return means


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


def _whole_step_context(names: list[str], inputs: PairLogps, params: LossParams) -> StepContext:
    """The context when ``inputs`` hold the whole step (running means read as 0, as TRL 1.16's BCO)."""
    lengths = inputs.chosen_lengths
    return build_step_context(
        names, params, StepPairs.of(inputs) if needs_step_pairs(names, train=False) else None,
        num_pairs=inputs.policy_chosen_logps.numel(),
        # a tensor in the log-probs' dtype: no host sync, no float32 rounding of the mean length
        chosen_tokens=None if lengths is None else lengths.to(inputs.policy_chosen_logps.dtype).sum(),
        running=None, train=False,
    )  # fmt: skip


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

    num_pairs = inputs.policy_chosen_logps.numel()
    if context is None:
        context = _whole_step_context(names, inputs, params)
    elif not isinstance(context, StepContext):
        raise TypeError(
            f"context must be a StepContext (from build_step_context(...).local(indices)), got {type(context).__name__}"
        )
    held = context.pairs_held()
    if held is not None and held != num_pairs:
        raise ValueError(
            f"context holds {held} pairs but inputs hold {num_pairs}: pass context.local(indices) of this micro-batch"
        )

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
