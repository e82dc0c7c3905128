"""The training objective: loss registry, input validation, the optimizer step's context, ``combined_loss``.

Every loss is defined on the pairs of one whole optimizer step (all micro-batches, all ranks), as
TRL 1.16 computes it on one batch holding all of them: the step's loss is
``sum_i losses[i] / P_step`` over the step's pairs, whatever micro-batches and ranks they are
split into, in value and in gradients. Per-pair losses (``sigmoid``, ``ipo``, ...) need nothing
more. Losses coupled to the batch need a little of the whole step, carried by :class:`StepContext`:

- ``sft`` (also ORPO's NLL, and RPO = another loss + weighted ``sft``): the step's chosen tokens
  per pair (from the data plan; no extra forward);
- ``aot`` / ``aot_unpaired``: each pair's quantile partner among the step's detached margins /
  log-ratios (:func:`prefixdpo.dpo.losses.quantile_partners`); needs :class:`StepPairs`;
- ``bco_pair``: delta, the running reward mean over training steps (:class:`BCORunningMean`),
  updated once per training step with all the step's rewards; needs :class:`StepPairs` to train.

Trainer protocol, once per optimizer step::

    pairs = StepPairs.cat([...]) if needs_step_pairs(loss_types, train=True) else None
    context = step_context(loss_types, params, pairs, num_pairs=P_step, chosen_tokens=C_step,
                           bco_state=state, train=True)
    for each micro-batch (step indices idx [P_local] of its pairs, in ``pairs``' order):
        losses, per_type = combined_loss(loss_types, weights, inputs, params, context.local(idx))
        (losses.sum() / P_step).backward()          # x num_processes under DDP's gradient mean

``StepPairs`` holds every pair of the step: under gradient accumulation the trainer gets them by a
no-grad forward over the step's micro-batches first, and across ranks by gathering them (every
rank then builds the same context); with one micro-batch per step the micro-batch's own detached
values (``StepPairs.of(inputs)``, gathered) serve, with no extra forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from prefixdpo.dpo.losses import (
    F_DIVERGENCES,
    LossConfigError,
    aot_loss,
    aot_unpaired_loss,
    apo_down_loss,
    apo_zero_loss,
    bco_pair_loss,
    discopop_loss,
    exo_pair_loss,
    f_divergence_scores,
    hinge_loss,
    ipo_loss,
    nca_pair_loss,
    orpo_loss,
    quantile_partners,
    rewards,
    robust_loss,
    sft_loss,
    sigmoid_loss,
    sigmoid_norm_loss,
    simpo_loss,
    sppo_hard_loss,
)

__all__ = [
    "PairLogps",
    "LossParams",
    "BCORunningMean",
    "StepPairs",
    "StepContext",
    "LossConfigError",
    "LOSSES",
    "LOSS_ALIASES",
    "REFERENCE_FREE",
    "NEEDS_NO_REFERENCE",
    "F_DIVERGENCE_LOSSES",
    "canonical_loss_types",
    "needs_step_pairs",
    "step_context",
    "combined_loss",
    "pair_rewards",
]


# ---------------------------------------------------------------------------------------------
# Inputs, parameters, state
# ---------------------------------------------------------------------------------------------


@dataclass
class PairLogps:
    """Per-pair log-prob statistics of the pairs one call computes losses for; every tensor is ``[P]``.

    ``policy_*``: summed log-probs of each response's tokens (LD-DPO's length-desensitised sums when
    ``ld_alpha`` is set); ``ref_*``: the same under the reference model (``None`` for reference-free
    losses); ``*_lengths``: response token counts; ``wpo_weights``: WPO's per-pair weight
    ``w_chosen * w_rejected`` (detached; only with ``use_weighting``).
    """

    policy_chosen_logps: Tensor
    policy_rejected_logps: Tensor
    ref_chosen_logps: Tensor | None = None
    ref_rejected_logps: Tensor | None = None
    chosen_lengths: Tensor | None = None
    rejected_lengths: Tensor | None = None
    wpo_weights: Tensor | None = None

    @property
    def has_reference(self) -> bool:
        return self.ref_chosen_logps is not None and self.ref_rejected_logps is not None


# The f-DPO reparameterisation leaves a beta*log Z(x) term that only cancels in the chosen-minus-
# rejected score difference, so only losses built on that difference generalise (TRL's set).
F_DIVERGENCE_LOSSES = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"})


@dataclass
class LossParams:
    """Hyper-parameters shared by the losses (defaults are TRL's).

    - ``beta``: DPO beta; IPO's tau; SimPO's beta (TRL ``CPOConfig.beta``).
    - ``label_smoothing``: cDPO / robust / EXO epsilon; also AOT's and SimPO's smoothing (as in TRL).
    - ``simpo_gamma``: SimPO's target reward margin gamma (TRL ``CPOConfig.simpo_gamma``).
    - ``orpo_alpha``: ORPO's lambda weighting the odds-ratio term (TRL ``ORPOConfig.beta``).
    - ``discopop_tau``: DiscoPOP's temperature tau.
    - ``f_divergence_type`` / ``f_alpha_divergence_coef``: f-DPO score transform (TRL's names).
    - ``use_weighting``: WPO (https://arxiv.org/abs/2406.11827): every loss of a pair multiplied by
      ``w_chosen * w_rejected``, ``w = exp(mean over the response's tokens of log p(y_t) - log sum_v p(v)^2)``
      under the policy, without gradient (TRL's ``use_weighting``; the inputs carry ``wpo_weights``).
    - ``ld_alpha``: LD-DPO's weight of the tokens past the shorter response's length, applied to policy
      and reference log-prob sums where they are computed (``prefixdpo.dpo.step.pair_logps``); ``None``: off.
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    orpo_alpha: float = 0.1
    discopop_tau: float = 0.05
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    use_weighting: bool = False
    ld_alpha: float | None = None


@dataclass
class BCORunningMean:
    """Running mean of implicit rewards over training steps, the ``delta`` of BCO
    (https://arxiv.org/abs/2404.04656).

    Count-weighted over every reward value seen (chosen and rejected alike). :func:`step_context`
    folds in each training step's rewards once, over all its pairs on all ranks (so every rank
    keeps the same mean), BEFORE the step's losses use it: the step's own rewards are included,
    as in the BCO paper's Algorithm 1 and TRL < 1.0, so the first step's delta is its reward mean
    rather than an arbitrary 0. (The price: training with ``bco_pair`` needs :class:`StepPairs`.)
    Evaluation reads the mean and never moves it. Save :meth:`state_dict` with checkpoints.
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
class StepPairs:
    """Detached log-probs of EVERY pair of one optimizer step (all micro-batches, all ranks); each ``[P_step]``.

    A pair's position here is its step index (what :meth:`StepContext.local` takes). Only the
    sorted AOT losses and training ``bco_pair`` need these (:func:`needs_step_pairs`); all need a
    reference. Response lengths are not here: ``sft``'s token count comes from the data plan.
    """

    policy_chosen_logps: Tensor
    policy_rejected_logps: Tensor
    ref_chosen_logps: Tensor
    ref_rejected_logps: Tensor

    @classmethod
    def of(cls, inputs: PairLogps) -> StepPairs:
        """The detached values of ``inputs`` (a micro-batch's, or a whole step's in one call)."""
        if not inputs.has_reference:
            raise ValueError("StepPairs need reference log-probs (ref_chosen_logps and ref_rejected_logps)")
        return cls(
            inputs.policy_chosen_logps.detach(), inputs.policy_rejected_logps.detach(),
            inputs.ref_chosen_logps.detach(), inputs.ref_rejected_logps.detach(),
        )  # fmt: skip

    @classmethod
    def cat(cls, parts: Sequence[StepPairs]) -> StepPairs:
        """Concatenate micro-batches' (or ranks') pairs in step-index order."""
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))

    @property
    def num_pairs(self) -> int:
        return self.policy_chosen_logps.numel()


@dataclass(frozen=True)
class StepContext:
    """What coupled losses need from the whole optimizer step; build with :func:`step_context`.

    - ``num_pairs``: pairs in the whole step, the divisor of the summed per-pair losses.
    - ``mean_chosen_tokens``: the step's chosen tokens / ``num_pairs`` (``sft``, ``orpo``).
    - ``bco_delta``: BCO's reward mean for this step.
    - ``aot_partners`` / ``aot_unpaired_partners``: :func:`prefixdpo.dpo.losses.quantile_partners`
      of the step's policy/reference margins and chosen/rejected log-ratios, each a pair of
      ``[P_step]`` tensors, or of ``[P_local]`` after :meth:`local`; ``None`` when not configured.
    """

    num_pairs: int
    mean_chosen_tokens: Tensor | float = 1.0
    bco_delta: float = 0.0
    aot_partners: tuple[Tensor, Tensor] | None = None
    aot_unpaired_partners: tuple[Tensor, Tensor] | None = None

    def local(self, indices: Tensor) -> StepContext:
        """The context of one micro-batch whose pairs have step indices ``indices`` ``[P_local]``."""

        def pick(partners):
            return None if partners is None else tuple(t[indices.to(t.device)] for t in partners)

        return replace(
            self, aot_partners=pick(self.aot_partners), aot_unpaired_partners=pick(self.aot_unpaired_partners)
        )

    def pairs_held(self) -> int | None:
        """Pairs the per-pair tensors hold (``P_step``, or ``P_local`` after :meth:`local`); None if none."""
        for partners in (self.aot_partners, self.aot_unpaired_partners):
            if partners is not None:
                return partners[0].numel()
        return None


# ---------------------------------------------------------------------------------------------
# Registry: name -> adapter (PairLogps, LossParams, StepContext) -> [P]
# ---------------------------------------------------------------------------------------------

LossFn = Callable[[PairLogps, LossParams, StepContext], Tensor]


def _logratios(x: PairLogps) -> tuple[Tensor, Tensor]:
    return x.policy_chosen_logps - x.ref_chosen_logps, x.policy_rejected_logps - x.ref_rejected_logps


def _scores(x: PairLogps, p: LossParams) -> tuple[Tensor, Tensor]:
    c, r = _logratios(x)
    return (
        f_divergence_scores(c, p.f_divergence_type, p.f_alpha_divergence_coef),
        f_divergence_scores(r, p.f_divergence_type, p.f_alpha_divergence_coef),
    )


LOSSES: dict[str, LossFn] = {
    "sigmoid": lambda x, p, c: sigmoid_loss(*_scores(x, p), p.beta, p.label_smoothing),
    "robust": lambda x, p, c: robust_loss(*_scores(x, p), p.beta, p.label_smoothing),
    "hinge": lambda x, p, c: hinge_loss(*_scores(x, p), p.beta),
    "ipo": lambda x, p, c: ipo_loss(*_scores(x, p), x.chosen_lengths, x.rejected_lengths, p.beta),
    "sigmoid_norm": lambda x, p, c: sigmoid_norm_loss(*_scores(x, p), x.chosen_lengths, x.rejected_lengths, p.beta),
    "exo_pair": lambda x, p, c: exo_pair_loss(*_scores(x, p), p.beta, p.label_smoothing),
    "nca_pair": lambda x, p, c: nca_pair_loss(*_logratios(x), p.beta),
    "bco_pair": lambda x, p, c: bco_pair_loss(*_logratios(x), p.beta, c.bco_delta),
    "sppo_hard": lambda x, p, c: sppo_hard_loss(*_logratios(x), p.beta),
    "aot": lambda x, p, c: aot_loss(
        x.policy_chosen_logps, x.policy_rejected_logps, x.ref_chosen_logps, x.ref_rejected_logps,
        p.beta, p.label_smoothing, c.aot_partners,
    ),
    "aot_unpaired": lambda x, p, c: aot_unpaired_loss(
        *_logratios(x), p.beta, p.label_smoothing, c.aot_unpaired_partners
    ),
    "apo_zero": lambda x, p, c: apo_zero_loss(*_logratios(x), p.beta),
    "apo_down": lambda x, p, c: apo_down_loss(*_logratios(x), p.beta),
    "discopop": lambda x, p, c: discopop_loss(*_scores(x, p), p.beta, p.discopop_tau),
    "sft": lambda x, p, c: sft_loss(x.policy_chosen_logps, x.chosen_lengths, c.mean_chosen_tokens),
    "simpo": lambda x, p, c: simpo_loss(
        x.policy_chosen_logps, x.policy_rejected_logps, x.chosen_lengths, x.rejected_lengths,
        p.beta, p.simpo_gamma, p.label_smoothing,
    ),
    "orpo": lambda x, p, c: orpo_loss(
        x.policy_chosen_logps, x.policy_rejected_logps, x.chosen_lengths, x.rejected_lengths, p.orpo_alpha,
        c.mean_chosen_tokens,
    ),
}  # fmt: skip

# The AOT issue calls the unpaired variant "aot_pair"; TRL calls it "aot_unpaired".
LOSS_ALIASES: dict[str, str] = {"aot_pair": "aot_unpaired"}

REFERENCE_FREE = frozenset({"simpo", "orpo"})
NEEDS_NO_REFERENCE = REFERENCE_FREE | {"sft"}
_NEEDS_LENGTHS = {
    "ipo": ("chosen_lengths", "rejected_lengths"),
    "sigmoid_norm": ("chosen_lengths", "rejected_lengths"),
    "simpo": ("chosen_lengths", "rejected_lengths"),
    "orpo": ("chosen_lengths", "rejected_lengths"),
    "sft": ("chosen_lengths",),
}
# Coupled losses and what of the step they need.
_TOKEN_MEAN = frozenset({"sft", "orpo"})
_SORTED = frozenset({"aot", "aot_unpaired"})
# WPO's weights are per pair: TRL refuses them for the sorted losses (a sort misaligns pairs and
# weights); its sft (a scalar expanded over the pairs) fails on the in-place weighting, so TRL
# gives sft with use_weighting no meaning to reproduce.
_NO_WEIGHTING = _SORTED | {"sft"}


def canonical_loss_types(loss_types: Iterable[str] | str) -> list[str]:
    """Loss names resolved through :data:`LOSS_ALIASES`; raises on an unknown, repeated or empty list."""
    names = [loss_types] if isinstance(loss_types, str) else list(loss_types)
    if not names:
        raise LossConfigError("loss_types is empty; give at least one loss type")
    canonical = []
    for name in names:
        resolved = LOSS_ALIASES.get(name, name)
        if resolved not in LOSSES:
            known = sorted(set(LOSSES) | set(LOSS_ALIASES))
            raise LossConfigError(f"unknown loss type {name!r}; known: {', '.join(known)}")
        canonical.append(resolved)
    if len(set(canonical)) != len(canonical):
        raise LossConfigError(f"loss type listed twice in {canonical}; merge their weights instead")
    return canonical


def needs_step_pairs(loss_types: Iterable[str] | str, *, train: bool = True) -> bool:
    """Whether :func:`step_context` needs :class:`StepPairs` for these losses (the sorted AOT losses
    always; ``bco_pair`` when training, to fold the step's rewards into its running mean)."""
    names = set(canonical_loss_types(loss_types))
    return bool(names & _SORTED) or (train and "bco_pair" in names)


def step_context(
    loss_types: Iterable[str] | str,
    params: LossParams,
    step_pairs: StepPairs | None,
    *,
    num_pairs: int,
    chosen_tokens: Tensor | float | None,
    bco_state: BCORunningMean | None,
    train: bool,
) -> StepContext:
    """The :class:`StepContext` of one optimizer step (or one evaluation batch); build it once per step.

    Args:
        loss_types: the configured losses (names or aliases).
        params: hyper-parameters (``beta`` scales BCO's rewards; AOT needs nothing from them here).
        step_pairs: every pair of the step, when :func:`needs_step_pairs` says so; else ``None``.
        num_pairs: pairs in the whole step (all micro-batches, all ranks).
        chosen_tokens: chosen-response tokens in the whole step (needed for ``sft`` / ``orpo``);
            counted as at least one, like TRL's clamp.
        bco_state: BCO's running mean; ``None`` gives TRL 1.16's delta = 0. Updated in place here
            with the step's rewards when ``train`` (eval reads it only).
        train: whether this is a training step.
    """
    names = set(canonical_loss_types(loss_types))
    # needs_step_pairs, except that without a BCO state there is no running mean to update
    uses_pairs = bool(names & _SORTED) or (train and "bco_pair" in names and bco_state is not None)
    # The arguments below come from the trainer, not from an option: a wrong one is a caller's bug, so a
    # plain ValueError (with its traceback), not a LossConfigError.
    if step_pairs is None and uses_pairs:
        raise ValueError(
            f"losses {', '.join(sorted(names & (_SORTED | {'bco_pair'})))} need step_pairs "
            "(detached log-probs of every pair of the step)"
        )
    if step_pairs is not None and step_pairs.num_pairs != num_pairs:
        raise ValueError(f"step_pairs holds {step_pairs.num_pairs} pairs but num_pairs={num_pairs}")

    mean_chosen_tokens: Tensor | float = 1.0
    if names & _TOKEN_MEAN:
        if chosen_tokens is None:
            raise ValueError(f"losses {', '.join(sorted(names & _TOKEN_MEAN))} need chosen_tokens of the step")
        total = chosen_tokens.clamp(min=1) if isinstance(chosen_tokens, Tensor) else max(chosen_tokens, 1)
        mean_chosen_tokens = total / max(num_pairs, 1)

    bco_delta = 0.0
    if "bco_pair" in names and bco_state is not None:
        if train:
            c = step_pairs.policy_chosen_logps - step_pairs.ref_chosen_logps
            r = step_pairs.policy_rejected_logps - step_pairs.ref_rejected_logps
            bco_state.update(params.beta * torch.cat([c, r]))
        bco_delta = bco_state.mean

    aot = aot_unpaired = None
    if step_pairs is not None:
        pc, pr = step_pairs.policy_chosen_logps, step_pairs.policy_rejected_logps
        rc, rr = step_pairs.ref_chosen_logps, step_pairs.ref_rejected_logps
        if "aot" in names:  # the same margins and log-ratios the loss functions sort
            aot = quantile_partners(pc - pr, rc - rr)
        if "aot_unpaired" in names:
            aot_unpaired = quantile_partners(pc - rc, pr - rr)
    return StepContext(num_pairs, mean_chosen_tokens, bco_delta, aot, aot_unpaired)


# ---------------------------------------------------------------------------------------------
# Validation and the combined objective
# ---------------------------------------------------------------------------------------------


def _check(name: str, inputs: PairLogps, params: LossParams) -> None:
    # A missing input is the caller's bug (the trainer supplies what the configured losses need): ValueError.
    # A bad option (f_divergence_type) is the user's: LossConfigError, printed as one line.
    if name not in NEEDS_NO_REFERENCE and not inputs.has_reference:
        raise ValueError(
            f"loss {name!r} needs reference log-probs (ref_chosen_logps and ref_rejected_logps); "
            f"losses without a reference: {', '.join(sorted(NEEDS_NO_REFERENCE))}"
        )
    for attr in _NEEDS_LENGTHS.get(name, ()):
        if getattr(inputs, attr) is None:
            raise ValueError(f"loss {name!r} needs {attr} (response token counts)")
    if params.use_weighting:
        if name in _NO_WEIGHTING:
            raise LossConfigError(f"use_weighting (WPO) is not defined for loss {name!r}, as in TRL 1.16")
        if inputs.wpo_weights is None:
            raise ValueError("use_weighting needs wpo_weights (pair_logps(..., params) computes them)")
    if params.f_divergence_type != "reverse_kl":
        if params.f_divergence_type not in F_DIVERGENCES:
            raise LossConfigError(
                f"unknown f_divergence_type {params.f_divergence_type!r}; known: {', '.join(F_DIVERGENCES)}"
            )
        if name not in F_DIVERGENCE_LOSSES:
            raise LossConfigError(
                f"f_divergence_type={params.f_divergence_type!r} is only defined for "
                f"{', '.join(sorted(F_DIVERGENCE_LOSSES))}; got loss {name!r}"
            )


def combined_loss(
    loss_types: list[str] | str,
    loss_weights: list[float] | None,
    inputs: PairLogps,
    params: LossParams | None = None,
    context: StepContext | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted sum of several losses, per pair (TRL's ``loss_type`` list + ``loss_weights``, e.g. MPO).

    Args:
        loss_types: names from :data:`LOSSES` (or :data:`LOSS_ALIASES`).
        loss_weights: one weight per loss type; ``None`` means 1.0 each.
        inputs: per-pair log-probs of this call's pairs, all ``[P]``.
        params: hyper-parameters (defaults: :class:`LossParams`()).
        context: the step's context for these pairs (``step_context(...).local(indices)``);
            ``None``: this call holds the whole step, and the context is built from ``inputs``
            (BCO's delta = 0, as TRL 1.16).

    Returns:
        ``(losses [P], {name: [P]})``: the weighted per-pair total, and each loss's per-pair values
        before its weight (after WPO's pair weight when ``params.use_weighting``, as TRL applies it). Summed over all the step's pairs and divided by ``P_step``, it equals
        TRL 1.16's loss on one batch of those pairs, in value and gradients. For the sorted AOT
        losses an entry is pair i's share of the sorted sum, not a loss of pair i alone.
    """
    params = params or LossParams()
    names = canonical_loss_types(loss_types)
    if loss_weights is None:
        loss_weights = [1.0] * len(names)
    if len(loss_weights) != len(names):
        raise LossConfigError(
            f"loss_weights has {len(loss_weights)} entries but loss_types has {len(names)} ({', '.join(names)})"
        )
    for name in names:
        _check(name, inputs, params)

    num_pairs = inputs.policy_chosen_logps.numel()
    if context is None:
        lengths = inputs.chosen_lengths
        context = step_context(
            names, params, StepPairs.of(inputs) if needs_step_pairs(names, train=False) else None,
            num_pairs=num_pairs,
            # a tensor in the log-probs' dtype: no host sync, no float32 rounding of the mean length
            chosen_tokens=None if lengths is None else lengths.to(inputs.policy_chosen_logps.dtype).sum(),
            bco_state=None, train=False,
        )  # fmt: skip
    elif not isinstance(context, StepContext):
        raise TypeError(
            f"context must be a StepContext (from step_context(...).local(indices)), got {type(context).__name__}"
        )
    held = context.pairs_held()
    if held is not None and held != num_pairs:
        raise ValueError(
            f"context holds {held} pairs but inputs hold {num_pairs}: pass context.local(indices) of this micro-batch"
        )

    total = torch.zeros_like(inputs.policy_chosen_logps)
    per_type: dict[str, Tensor] = {}
    for name, weight in zip(names, loss_weights):
        loss = LOSSES[name](inputs, params, context)
        if params.use_weighting:
            loss = loss * inputs.wpo_weights
        per_type[name] = loss
        total = total + weight * loss
    return total, per_type


# ---------------------------------------------------------------------------------------------
# Implicit rewards, for metrics
# ---------------------------------------------------------------------------------------------


def pair_rewards(inputs: PairLogps, beta: float) -> tuple[Tensor, Tensor]:
    """``(chosen_rewards, rejected_rewards)``, each ``[P]``: reference rewards when ``inputs`` has a
    reference, else length-normalised ones (see :func:`prefixdpo.dpo.losses.rewards`)."""
    if inputs.has_reference:
        return (
            rewards(inputs.policy_chosen_logps, inputs.ref_chosen_logps, beta),
            rewards(inputs.policy_rejected_logps, inputs.ref_rejected_logps, beta),
        )
    return (
        rewards(inputs.policy_chosen_logps, None, beta, inputs.chosen_lengths),
        rewards(inputs.policy_rejected_logps, None, beta, inputs.rejected_lengths),
    )
