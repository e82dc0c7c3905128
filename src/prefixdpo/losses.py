"""Preference losses on per-pair sequence log-probs.

Every loss here is a small pure function on 1-D tensors of length ``P`` (one entry per preference
pair) and returns per-pair losses ``[P]``. Reduction is left to the caller: with gradient
accumulation over micro-batches holding different numbers of pairs, the trainer must sum per-pair
losses and divide by the step's total pair count, which a per-micro-batch mean would get wrong.

Names follow TRL 1.x ``DPOConfig.loss_type`` and each formula equals TRL 1.16's
``DPOTrainer._compute_loss`` (the mean over pairs of our ``[P]`` equals TRL's scalar), except where
a docstring says otherwise. The reference-free ``simpo`` and ``orpo`` follow TRL's experimental
``CPOTrainer.cpo_loss`` / ``ORPOTrainer.odds_ratio_loss``.

Inputs (all ``[P]``, gathered in :class:`PairLogps`):

- ``policy_chosen_logps`` / ``policy_rejected_logps``: summed log-probs of each response's tokens;
- ``ref_chosen_logps`` / ``ref_rejected_logps``: the same under the reference model (``None`` for
  reference-free losses);
- ``chosen_lengths`` / ``rejected_lengths``: response token counts, for length-normalised losses.

Shared parameters live in :class:`LossParams`; like TRL, ``beta`` means whatever the loss's paper
calls its temperature/regulariser (IPO's tau, SimPO's beta, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PairLogps",
    "LossParams",
    "BCORunningMean",
    "LossConfigError",
    "LOSSES",
    "LOSS_ALIASES",
    "REFERENCE_FREE",
    "NEEDS_NO_REFERENCE",
    "combined_loss",
    "rewards",
    "pair_rewards",
    "f_divergence_scores",
    "sigmoid_loss",
    "robust_loss",
    "hinge_loss",
    "ipo_loss",
    "sigmoid_norm_loss",
    "exo_pair_loss",
    "nca_pair_loss",
    "bco_pair_loss",
    "sppo_hard_loss",
    "aot_loss",
    "aot_unpaired_loss",
    "apo_zero_loss",
    "apo_down_loss",
    "discopop_loss",
    "sft_loss",
    "simpo_loss",
    "orpo_loss",
]


class LossConfigError(ValueError):
    """An unknown loss name, a missing input a loss needs, or inconsistent loss settings."""


# ---------------------------------------------------------------------------------------------
# Inputs, parameters, state
# ---------------------------------------------------------------------------------------------


@dataclass
class PairLogps:
    """Per-pair log-prob statistics; every tensor is ``[P]``.

    ``chosen_wpo_logps`` / ``rejected_wpo_logps`` are only needed for ``LossParams.use_weighting``
    (WPO, https://arxiv.org/abs/2406.11827): the mean over a response's tokens of
    ``log p(y_t) - log sum_v p(v)^2`` (TRL's "aligned" log-probs), computed without gradient.
    """

    policy_chosen_logps: Tensor
    policy_rejected_logps: Tensor
    ref_chosen_logps: Tensor | None = None
    ref_rejected_logps: Tensor | None = None
    chosen_lengths: Tensor | None = None
    rejected_lengths: Tensor | None = None
    chosen_wpo_logps: Tensor | None = None
    rejected_wpo_logps: Tensor | None = None

    @property
    def has_reference(self) -> bool:
        return self.ref_chosen_logps is not None and self.ref_rejected_logps is not None


F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
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
    - ``use_weighting``: WPO pair weights (needs ``PairLogps.*_wpo_logps``).
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    orpo_alpha: float = 0.1
    discopop_tau: float = 0.05
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    use_weighting: bool = False


@dataclass
class BCORunningMean:
    """Running mean of implicit rewards, the ``delta`` of BCO (https://arxiv.org/abs/2404.04656).

    Count-weighted over every reward value seen (chosen and rejected alike), so micro-batches of
    different sizes weigh in by their pair count. Under data parallelism, pass rewards gathered
    from all ranks to :meth:`update` so every rank keeps the same mean.
    """

    mean: float = 0.0
    count: int = 0

    def update(self, values: Tensor) -> float:
        """Fold ``values`` (any shape, detached here) into the mean; return the new mean."""
        values = values.detach().float().flatten()
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


# ---------------------------------------------------------------------------------------------
# Pure loss functions. "scores" are per-pair log-ratios log pi(y|x) - log pi_ref(y|x) (or their
# f-divergence transform); every tensor argument and every result is [P].
# ---------------------------------------------------------------------------------------------


def f_divergence_scores(logratios: Tensor, f_divergence_type: str = "reverse_kl", alpha: float = 0.5) -> Tensor:
    """f'(t) at t = pi/pi_ref, the f-DPO score (https://arxiv.org/abs/2309.16240). ``[P] -> [P]``.

    ``reverse_kl`` is standard DPO (the log-ratio itself).
    """
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":  # f'(t) = 1 - 1/t
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":  # f'(t) = log(2t / (t + 1))
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":  # f'(t) = (t^(alpha-1) - 1) / (alpha - 1)
        if abs(alpha - 1.0) < 1e-6:  # the limit alpha -> 1 is log t
            return logratios
        t = (alpha - 1.0) * logratios
        # clamp so exp() stays finite once cast back to a half-precision dtype
        clamp_max = {torch.float16: 11.0}.get(t.dtype, 80.0)
        return (torch.exp(torch.clamp(t.float(), max=clamp_max)) - 1.0).to(t.dtype) / (alpha - 1.0)
    raise LossConfigError(f"unknown f_divergence_type {f_divergence_type!r}; known: {', '.join(F_DIVERGENCES)}")


def sigmoid_loss(chosen_scores: Tensor, rejected_scores: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """DPO, https://arxiv.org/abs/2305.18290; with ``label_smoothing`` > 0 it is cDPO
    (https://ericmitchell.ai/cdpo.pdf). ``[P] -> [P]``.

    ``-(1-eps) logsigmoid(beta d) - eps logsigmoid(-beta d)``, ``d = chosen - rejected``.
    TRL 1.16's ``sigmoid`` ignores ``label_smoothing`` (it equals this at eps = 0); TRL < 1.0 and
    torchtune apply it as here.
    """
    logits = beta * (chosen_scores - rejected_scores)
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def robust_loss(chosen_scores: Tensor, rejected_scores: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """Robust DPO (rDPO), https://arxiv.org/abs/2403.00409, eps = ``label_smoothing`` in [0, 0.5). ``[P] -> [P]``."""
    if not 0.0 <= label_smoothing < 0.5:
        raise LossConfigError(f"robust loss needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    logits = beta * (chosen_scores - rejected_scores)
    clean = -(1 - label_smoothing) * F.logsigmoid(logits)
    flipped = -label_smoothing * F.logsigmoid(-logits)
    return (clean - flipped) / (1 - 2 * label_smoothing)


def hinge_loss(chosen_scores: Tensor, rejected_scores: Tensor, beta: float) -> Tensor:
    """SLiC hinge loss, https://arxiv.org/abs/2305.10425: ``relu(1 - beta d)``. ``[P] -> [P]``."""
    return torch.relu(1 - beta * (chosen_scores - rejected_scores))


def _per_token(scores: Tensor, lengths: Tensor) -> Tensor:
    # TRL clamps at one token so an empty response cannot divide by zero.
    return scores / lengths.to(scores.dtype).clamp(min=1.0)


def ipo_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, chosen_lengths: Tensor, rejected_lengths: Tensor, beta: float
) -> Tensor:
    """IPO, https://arxiv.org/abs/2310.12036 eq. 17, beta = tau. ``[P] -> [P]``.

    Like TRL, the log-ratios are averaged per token first (the IPO authors' normalisation), so the
    squared loss does not grow with response length.
    """
    delta = _per_token(chosen_scores, chosen_lengths) - _per_token(rejected_scores, rejected_lengths)
    return (delta - 1 / (2 * beta)) ** 2


def sigmoid_norm_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, chosen_lengths: Tensor, rejected_lengths: Tensor, beta: float
) -> Tensor:
    """DPO on per-token-averaged log-ratios (TRL's ``sigmoid_norm``). ``[P] -> [P]``."""
    delta = _per_token(chosen_scores, chosen_lengths) - _per_token(rejected_scores, rejected_lengths)
    return -F.logsigmoid(beta * delta)


def exo_pair_loss(chosen_scores: Tensor, rejected_scores: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """EXO-pref, https://arxiv.org/abs/2402.00856 eq. 16: KL(p_f || p_rh) over {chosen, rejected}
    with p_rh = (1 - eps, eps); needs eps = ``label_smoothing`` > 0 (paper: 1e-3). ``[P] -> [P]``."""
    if not 0.0 < label_smoothing < 1.0:
        raise LossConfigError(f"exo_pair needs 0 < label_smoothing < 1 (the paper uses 1e-3), got {label_smoothing}")
    logits = beta * (chosen_scores - rejected_scores)
    q_w, log_q_w = torch.sigmoid(logits), F.logsigmoid(logits)
    q_l, log_q_l = torch.sigmoid(-logits), F.logsigmoid(-logits)
    return q_w * (log_q_w - math.log1p(-label_smoothing)) + q_l * (log_q_l - math.log(label_smoothing))


def nca_pair_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    """NCA, https://arxiv.org/abs/2402.05369. ``[P] -> [P]``."""
    r_c, r_r = beta * chosen_logratios, beta * rejected_logratios
    return -F.logsigmoid(r_c) - 0.5 * F.logsigmoid(-r_c) - 0.5 * F.logsigmoid(-r_r)


def bco_pair_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float, delta: float = 0.0) -> Tensor:
    """BCO on pairs, https://arxiv.org/abs/2404.04656. ``[P] -> [P]``.

    ``-logsigmoid(r_c - delta) - logsigmoid(-(r_r - delta))`` with ``r = beta * logratio``.
    ``delta`` is the running reward mean (:class:`BCORunningMean`); TRL 1.16 dropped it, which is
    ``delta = 0`` here (the default).
    """
    r_c, r_r = beta * chosen_logratios, beta * rejected_logratios
    return -F.logsigmoid(r_c - delta) - F.logsigmoid(-(r_r - delta))


def sppo_hard_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    """SPPO with hard win probabilities (1 for chosen, 0 for rejected), https://arxiv.org/abs/2405.00675
    eq. 4.7. ``[P] -> [P]``."""
    return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2


def _smoothed_logistic(delta: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing


def aot_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> Tensor:
    """AOT (paired), https://arxiv.org/abs/2406.05882. ``[P] -> [P]``.

    Sorts the policy and reference chosen-minus-rejected margins over the batch independently, so
    entry i of the result belongs to the i-th quantile, not to pair i (only its sum/mean is
    meaningful), and the sort runs over whatever pairs one call receives.
    """
    policy_margin, _ = torch.sort(policy_chosen_logps - policy_rejected_logps, dim=0)
    ref_margin, _ = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)
    return _smoothed_logistic(policy_margin - ref_margin, beta, label_smoothing)


def aot_unpaired_loss(
    chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float, label_smoothing: float = 0.0
) -> Tensor:
    """AOT (unpaired), https://arxiv.org/abs/2406.05882: sorts chosen and rejected log-ratios over the
    batch independently (entry i is a quantile, not pair i). ``[P] -> [P]``."""
    chosen_sorted, _ = torch.sort(chosen_logratios, dim=0)
    rejected_sorted, _ = torch.sort(rejected_logratios, dim=0)
    return _smoothed_logistic(chosen_sorted - rejected_sorted, beta, label_smoothing)


def apo_zero_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    """APO-zero, https://arxiv.org/abs/2408.06266 eq. 7: raise chosen, lower rejected likelihood. ``[P] -> [P]``."""
    return (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)


def apo_down_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    """APO-down, https://arxiv.org/abs/2408.06266 eq. 8: lower both, rejected more. ``[P] -> [P]``."""
    return torch.sigmoid(beta * chosen_logratios) + (
        1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
    )


def discopop_loss(chosen_scores: Tensor, rejected_scores: Tensor, beta: float, tau: float = 0.05) -> Tensor:
    """DiscoPOP (log-ratio modulated loss), https://arxiv.org/abs/2406.08414 eq. 5. ``[P] -> [P]``.

    Blends the logistic loss and the exponential loss ``exp(-beta d)`` with weight ``sigmoid(beta d / tau)``.
    """
    logits = beta * (chosen_scores - rejected_scores)
    mix = torch.sigmoid(logits / tau)
    return -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix


def sft_loss(policy_chosen_logps: Tensor, chosen_lengths: Tensor) -> Tensor:
    """NLL of the chosen responses, normalised as TRL does: per token over the whole batch. ``[P] -> [P]``.

    The batch value ``-sum(chosen logps) / sum(chosen lengths)`` is repeated for every pair, so the
    mean over pairs equals TRL's scalar and gradients flow to every pair in proportion to its tokens
    (a long response weighs more than a short one, unlike a per-sequence average).
    """
    batch_nll = -policy_chosen_logps.sum() / chosen_lengths.to(policy_chosen_logps.dtype).sum().clamp(min=1.0)
    return batch_nll.expand_as(policy_chosen_logps)


def simpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> Tensor:
    """SimPO, https://arxiv.org/abs/2405.14734 eq. 6 (reference-free). ``[P] -> [P]``.

    ``-logsigmoid(beta * (avg_c - avg_r) - gamma)`` on per-token average log-probs, smoothed by
    ``label_smoothing`` like TRL's ``CPOTrainer`` (``loss_type="simpo"``, ``cpo_alpha=0``).
    """
    margin = _per_token(policy_chosen_logps, chosen_lengths) - _per_token(policy_rejected_logps, rejected_lengths)
    return _smoothed_logistic(margin - gamma / beta, beta, label_smoothing)


def _log1mexp(x: Tensor) -> Tensor:
    # log(1 - exp(x)) for x <= 0, branching at -ln 2 to avoid cancellation (Maechler 2012).
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    alpha: float,
) -> Tensor:
    """ORPO, https://arxiv.org/abs/2403.07691 eqs. 4-7 (reference-free). ``[P] -> [P]``.

    ``L_SFT - alpha * logsigmoid(log odds(avg_c) - log odds(avg_r))`` with ``odds(a) = e^a / (1 - e^a)``
    on per-token average log-probs; ``alpha`` is the paper's lambda (TRL ``ORPOConfig.beta``).
    ``L_SFT`` is :func:`sft_loss` (chosen-response NLL, per token over the batch). TRL's ORPO also
    counts the prompt's tokens in that NLL; here the prompt is shared and not a target, and the
    paper's L_SFT is over the response only.
    """
    # at least fp32, as TRL: log1mexp near 0 is ill-conditioned in half precision
    dtype = torch.promote_types(policy_chosen_logps.dtype, torch.float32)
    avg_c = _per_token(policy_chosen_logps, chosen_lengths).to(dtype)
    avg_r = _per_token(policy_rejected_logps, rejected_lengths).to(dtype)
    log_odds = (avg_c - avg_r) - (_log1mexp(avg_c) - _log1mexp(avg_r))
    odds_term = -alpha * F.logsigmoid(log_odds)
    return sft_loss(policy_chosen_logps, chosen_lengths) + odds_term.to(policy_chosen_logps.dtype)


# ---------------------------------------------------------------------------------------------
# Registry: name -> adapter (PairLogps, LossParams, BCORunningMean | None) -> [P]
# ---------------------------------------------------------------------------------------------

LossFn = Callable[[PairLogps, LossParams, "BCORunningMean | None"], Tensor]


def _logratios(x: PairLogps) -> tuple[Tensor, Tensor]:
    return x.policy_chosen_logps - x.ref_chosen_logps, x.policy_rejected_logps - x.ref_rejected_logps


def _scores(x: PairLogps, p: LossParams) -> tuple[Tensor, Tensor]:
    c, r = _logratios(x)
    return (
        f_divergence_scores(c, p.f_divergence_type, p.f_alpha_divergence_coef),
        f_divergence_scores(r, p.f_divergence_type, p.f_alpha_divergence_coef),
    )


def _bco(x: PairLogps, p: LossParams, state: BCORunningMean | None) -> Tensor:
    c, r = _logratios(x)
    delta = 0.0
    if state is not None:
        # the paper's delta includes the current batch's rewards (as TRL < 1.0 did)
        delta = state.update(p.beta * torch.cat([c, r]))
    return bco_pair_loss(c, r, p.beta, delta)


LOSSES: dict[str, LossFn] = {
    "sigmoid": lambda x, p, s: sigmoid_loss(*_scores(x, p), p.beta, p.label_smoothing),
    "robust": lambda x, p, s: robust_loss(*_scores(x, p), p.beta, p.label_smoothing),
    "hinge": lambda x, p, s: hinge_loss(*_scores(x, p), p.beta),
    "ipo": lambda x, p, s: ipo_loss(*_scores(x, p), x.chosen_lengths, x.rejected_lengths, p.beta),
    "sigmoid_norm": lambda x, p, s: sigmoid_norm_loss(*_scores(x, p), x.chosen_lengths, x.rejected_lengths, p.beta),
    "exo_pair": lambda x, p, s: exo_pair_loss(*_scores(x, p), p.beta, p.label_smoothing),
    "nca_pair": lambda x, p, s: nca_pair_loss(*_logratios(x), p.beta),
    "bco_pair": _bco,
    "sppo_hard": lambda x, p, s: sppo_hard_loss(*_logratios(x), p.beta),
    "aot": lambda x, p, s: aot_loss(
        x.policy_chosen_logps, x.policy_rejected_logps, x.ref_chosen_logps, x.ref_rejected_logps,
        p.beta, p.label_smoothing,
    ),
    "aot_unpaired": lambda x, p, s: aot_unpaired_loss(*_logratios(x), p.beta, p.label_smoothing),
    "apo_zero": lambda x, p, s: apo_zero_loss(*_logratios(x), p.beta),
    "apo_down": lambda x, p, s: apo_down_loss(*_logratios(x), p.beta),
    "discopop": lambda x, p, s: discopop_loss(*_scores(x, p), p.beta, p.discopop_tau),
    "sft": lambda x, p, s: sft_loss(x.policy_chosen_logps, x.chosen_lengths),
    "simpo": lambda x, p, s: simpo_loss(
        x.policy_chosen_logps, x.policy_rejected_logps, x.chosen_lengths, x.rejected_lengths,
        p.beta, p.simpo_gamma, p.label_smoothing,
    ),
    "orpo": lambda x, p, s: orpo_loss(
        x.policy_chosen_logps, x.policy_rejected_logps, x.chosen_lengths, x.rejected_lengths, p.orpo_alpha
    ),
}

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
# Sorting permutes pairs, so per-pair WPO weights would attach to the wrong entries (TRL refuses too).
_NO_WEIGHTING = frozenset({"aot", "aot_unpaired"})


def _canonical(name: str) -> str:
    name = LOSS_ALIASES.get(name, name)
    if name not in LOSSES:
        known = sorted(set(LOSSES) | set(LOSS_ALIASES))
        raise LossConfigError(f"unknown loss type {name!r}; known: {', '.join(known)}")
    return name


def _check(name: str, inputs: PairLogps, params: LossParams) -> None:
    if name not in NEEDS_NO_REFERENCE and not inputs.has_reference:
        raise LossConfigError(
            f"loss {name!r} needs reference log-probs (ref_chosen_logps and ref_rejected_logps); "
            f"losses without a reference: {', '.join(sorted(NEEDS_NO_REFERENCE))}"
        )
    for attr in _NEEDS_LENGTHS.get(name, ()):
        if getattr(inputs, attr) is None:
            raise LossConfigError(f"loss {name!r} needs {attr} (response token counts)")
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
    if params.use_weighting:
        if name in _NO_WEIGHTING:
            raise LossConfigError(f"use_weighting (WPO) is not defined for {name!r}: it sorts pairs")
        if inputs.chosen_wpo_logps is None or inputs.rejected_wpo_logps is None:
            raise LossConfigError("use_weighting (WPO) needs chosen_wpo_logps and rejected_wpo_logps")


def combined_loss(
    loss_types: list[str] | str,
    loss_weights: list[float] | None,
    inputs: PairLogps,
    params: LossParams | None = None,
    bco_state: BCORunningMean | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted sum of several losses, per pair (TRL's ``loss_type`` list + ``loss_weights``, e.g. MPO).

    Args:
        loss_types: names from :data:`LOSSES` (or :data:`LOSS_ALIASES`).
        loss_weights: one weight per loss type; ``None`` means 1.0 each.
        inputs: per-pair log-probs, all ``[P]``.
        params: hyper-parameters (defaults: :class:`LossParams`()).
        bco_state: running reward mean for ``bco_pair``; ``None`` gives TRL 1.16's delta = 0.
            It is updated in place when ``bco_pair`` is among the losses.

    Returns:
        ``(losses [P], {name: [P]})``: the weighted per-pair total, and each loss's per-pair values
        before its weight (after WPO weighting, when on). ``losses.mean()`` equals TRL's loss.
    """
    params = params or LossParams()
    names = [loss_types] if isinstance(loss_types, str) else list(loss_types)
    if not names:
        raise LossConfigError("loss_types is empty; give at least one loss type")
    if loss_weights is None:
        loss_weights = [1.0] * len(names)
    if len(loss_weights) != len(names):
        raise LossConfigError(
            f"loss_weights has {len(loss_weights)} entries but loss_types has {len(names)} ({', '.join(names)})"
        )
    names = [_canonical(n) for n in names]
    if len(set(names)) != len(names):
        raise LossConfigError(f"loss type listed twice in {names}; merge their weights instead")
    for name in names:
        _check(name, inputs, params)

    pair_weights = None
    if params.use_weighting:
        # WPO eq. 2: w = exp(mean aligned logp of chosen) * exp(... of rejected), no gradient.
        pair_weights = torch.exp(inputs.chosen_wpo_logps.detach() + inputs.rejected_wpo_logps.detach())

    total = torch.zeros_like(inputs.policy_chosen_logps)
    per_type: dict[str, Tensor] = {}
    for name, weight in zip(names, loss_weights):
        loss = LOSSES[name](inputs, params, bco_state)
        if pair_weights is not None:
            loss = loss * pair_weights
        per_type[name] = loss
        total = total + weight * loss
    return total, per_type


# ---------------------------------------------------------------------------------------------
# Implicit rewards, for metrics
# ---------------------------------------------------------------------------------------------


def rewards(
    policy_logps: Tensor, ref_logps: Tensor | None, beta: float, lengths: Tensor | None = None
) -> Tensor:
    """Implicit rewards for logging (detached). ``[P] -> [P]``.

    With a reference: TRL's DPO reward ``beta * (policy - ref)``. Without one (SimPO, ORPO): the
    reward SimPO defines and TRL's CPO/ORPO trainers log, ``beta * policy / lengths`` (per-token
    average log-prob); ``lengths`` is then required.
    """
    if ref_logps is not None:
        return (beta * (policy_logps - ref_logps)).detach()
    if lengths is None:
        raise LossConfigError("reference-free rewards need lengths (response token counts)")
    return (beta * _per_token(policy_logps, lengths)).detach()


def pair_rewards(inputs: PairLogps, beta: float) -> tuple[Tensor, Tensor]:
    """``(chosen_rewards, rejected_rewards)``, each ``[P]``: reference rewards when ``inputs`` has a
    reference, else length-normalised ones (see :func:`rewards`)."""
    if inputs.has_reference:
        return (
            rewards(inputs.policy_chosen_logps, inputs.ref_chosen_logps, beta),
            rewards(inputs.policy_rejected_logps, inputs.ref_rejected_logps, beta),
        )
    return (
        rewards(inputs.policy_chosen_logps, None, beta, inputs.chosen_lengths),
        rewards(inputs.policy_rejected_logps, None, beta, inputs.rejected_lengths),
    )
