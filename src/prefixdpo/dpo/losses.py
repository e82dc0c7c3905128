"""Preference losses on per-pair sequence log-probs: small pure functions, one per loss.

Each takes 1-D tensors of length ``P`` (one entry per preference pair) and returns per-pair losses ``[P]``.
A loss coupled to the whole optimizer step (``sft``'s token mean, the sorted AOT losses, BCO's reward
mean) takes that part as an argument (``mean_chosen_tokens``, ``partners``, ``delta``); left at its
default, the call itself is the whole step. Names follow TRL 1.x ``DPOConfig.loss_type`` and each formula
equals TRL 1.16's ``DPOTrainer._compute_loss`` on one batch holding the step's pairs, unless a docstring
says otherwise; ``simpo`` and ``orpo`` follow TRL's ``CPOTrainer`` / ``ORPOTrainer``.

Arguments: ``*_logps`` summed log-probs of a response's tokens; ``*_logratios`` policy - reference;
``*_scores`` log-ratios after :func:`f_divergence_scores`; ``*_lengths`` response token counts. What each
loss needs, and how it is called, is its row in :mod:`prefixdpo.dpo.loss_table`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from prefixdpo.errors import ConfigError

__all__ = [
    "LossConfigError",
    "F_DIVERGENCES",
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
    "quantile_partners",
    "quantile_matched_loss",
    "aot_loss",
    "aot_unpaired_loss",
    "apo_zero_loss",
    "apo_down_loss",
    "discopop_loss",
    "sft_loss",
    "simpo_loss",
    "orpo_loss",
    "rewards",
]


class LossConfigError(ConfigError):
    """An unknown loss name or an inconsistent loss setting (an option the user gave)."""


def _alpha_divergence(logratios: Tensor, alpha: float) -> Tensor:
    # f'(t) = (t^(alpha-1) - 1) / (alpha - 1)
    if abs(alpha - 1.0) < 1e-6:  # the limit alpha -> 1 is log t
        return logratios
    t = (alpha - 1.0) * logratios
    # clamp so exp() stays finite once cast back to a half-precision dtype
    clamp_max = {torch.float16: 11.0}.get(t.dtype, 80.0)
    return (torch.exp(torch.clamp(t.float(), max=clamp_max)) - 1.0).to(t.dtype) / (alpha - 1.0)


# f'(t) at t = pi / pi_ref as a function of (log t, alpha), by TRL's f_divergence_type names
F_DIVERGENCES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "reverse_kl": lambda logratios, alpha: logratios,  # standard DPO
    "forward_kl": lambda logratios, alpha: 1 - torch.exp(-logratios),  # f'(t) = 1 - 1/t
    "js_divergence": lambda logratios, alpha: math.log(2) + F.logsigmoid(logratios),  # f'(t) = log(2t / (t + 1))
    "alpha_divergence": _alpha_divergence,
}


def f_divergence_scores(logratios: Tensor, f_divergence_type: str = "reverse_kl", alpha: float = 0.5) -> Tensor:
    """f'(t) at t = pi/pi_ref, the f-DPO score (https://arxiv.org/abs/2309.16240). ``[P] -> [P]``.

    ``f_divergence_type``: a key of :data:`F_DIVERGENCES` (the loss table refuses others, once).
    """
    return F_DIVERGENCES[f_divergence_type](logratios, alpha)


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
    ``delta`` is the running reward mean over training steps (``prefixdpo.dpo.coupling.RunningMean``);
    TRL 1.16 dropped it, which is ``delta = 0`` here (the default).
    """
    r_c, r_r = beta * chosen_logratios, beta * rejected_logratios
    return -F.logsigmoid(r_c - delta) - F.logsigmoid(-(r_r - delta))


def sppo_hard_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    """SPPO with hard win probabilities (1 for chosen, 0 for rejected), https://arxiv.org/abs/2405.00675
    eq. 4.7. ``[P] -> [P]``."""
    return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2


def _smoothed_logistic(delta: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing


def quantile_partners(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Partners of each entry when ``a`` and ``b`` are sorted independently. ``[N], [N] -> [N], [N]``.

    Returns ``(b_at_rank_of_a, a_at_rank_of_b)``, detached: entry i of the first is the k-th
    smallest ``b`` where k is the rank of ``a[i]`` among ``a``, and vice versa. Pass the values of
    every pair of the optimizer step, then pick each micro-batch's entries by step index. Tied
    values may take their ranks in either order: the partners of tied entries then swap, which
    changes neither :func:`quantile_matched_loss`'s sum nor its summed gradient over the tie.
    """
    a, b = a.detach(), b.detach()
    a_sorted, a_order = torch.sort(a, stable=True)
    b_sorted, b_order = torch.sort(b, stable=True)
    b_at_rank_of_a = torch.empty_like(b).index_copy_(0, a_order, b_sorted)
    a_at_rank_of_b = torch.empty_like(a).index_copy_(0, b_order, a_sorted)
    return b_at_rank_of_a, a_at_rank_of_b


def quantile_matched_loss(
    a: Tensor, b: Tensor, beta: float, label_smoothing: float = 0.0, partners: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """Per-pair share of ``sum_k f(a_(k) - b_(k))`` (a, b sorted independently over the step). All ``[P]``.

    ``f`` is the label-smoothed logistic loss at ``beta``. Entry i is ``f(a_i - B[rank_a(i)])``,
    whose gradient w.r.t. ``a_i`` is that of the sorted sum (a sort only routes gradients), plus
    ``g - g.detach()`` with ``g = f(A[rank_b(i)] - b_i)``: zero in value, it carries the sorted
    sum's gradient w.r.t. ``b_i``. Summed over all the step's pairs, value and gradients equal the
    sorted formula's, however the pairs are split. ``partners``: ``(b_at_rank_of_a, a_at_rank_of_b)``,
    :func:`quantile_partners` of the step's values picked for these pairs ``([P], [P])``, possibly gathered in
    another dtype or on the host (they take ``a``'s / ``b``'s dtype and device here); ``None``: this call is the
    whole step.
    """
    b_at_rank_of_a, a_at_rank_of_b = partners if partners is not None else quantile_partners(a, b)
    b_at_rank_of_a, a_at_rank_of_b = b_at_rank_of_a.to(a), a_at_rank_of_b.to(b)
    carrier = _smoothed_logistic(a_at_rank_of_b - b, beta, label_smoothing)
    return _smoothed_logistic(a - b_at_rank_of_a, beta, label_smoothing) + (carrier - carrier.detach())


def aot_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    partners: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """AOT (paired), https://arxiv.org/abs/2406.05882. ``[P] -> [P]``.

    TRL sorts the policy and the reference chosen-minus-rejected margins over the batch
    independently and matches them by quantile; this is :func:`quantile_matched_loss` with
    ``a`` = policy margins, ``b`` = reference margins. ``partners``: :func:`quantile_partners` of
    the step's margins, picked for these pairs ``([P], [P])``; ``None``: this call is the whole step.
    """
    policy_margins = policy_chosen_logps - policy_rejected_logps
    ref_margins = ref_chosen_logps - ref_rejected_logps
    return quantile_matched_loss(policy_margins, ref_margins, beta, label_smoothing, partners)


def aot_unpaired_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float, label_smoothing: float = 0.0,
                      partners: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """AOT (unpaired), https://arxiv.org/abs/2406.05882. ``[P] -> [P]``.

    TRL sorts the chosen and the rejected log-ratios over the batch independently; this is
    :func:`quantile_matched_loss` with ``a`` = chosen, ``b`` = rejected log-ratios. ``partners`` as
    in :func:`aot_loss`, of the step's log-ratios.
    """
    return quantile_matched_loss(chosen_logratios, rejected_logratios, beta, label_smoothing, partners)


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


def sft_loss(
    policy_chosen_logps: Tensor, chosen_lengths: Tensor, mean_chosen_tokens: Tensor | float | None = None
) -> Tensor:
    """NLL of the chosen responses, per token over the whole step as TRL normalises it. ``[P] -> [P]``.

    Entry i is ``-logp_c[i] / mean_chosen_tokens``, with ``mean_chosen_tokens`` = the step's chosen
    tokens / the step's pairs (a scalar); the mean over the step's pairs is then TRL's
    ``-sum(logp_c) / sum(len_c)``, and each pair's gradient is its share of that token mean (a long
    response weighs more than a short one, unlike a per-sequence average). ``None``: this call is
    the whole step (the mean of ``chosen_lengths``, at least one token in all).
    """
    if mean_chosen_tokens is None:
        total = chosen_lengths.to(policy_chosen_logps.dtype).sum().clamp(min=1.0)
        mean_chosen_tokens = total / policy_chosen_logps.numel()
    return -policy_chosen_logps / mean_chosen_tokens


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
    mean_chosen_tokens: Tensor | float | None = None,
) -> Tensor:
    """ORPO, https://arxiv.org/abs/2403.07691 eqs. 4-7 (reference-free). ``[P] -> [P]``.

    ``L_SFT - alpha * logsigmoid(log odds(avg_c) - log odds(avg_r))`` with ``odds(a) = e^a / (1 - e^a)``
    on per-token average log-probs; ``alpha`` is the paper's lambda (TRL ``ORPOConfig.beta``).
    ``L_SFT`` is :func:`sft_loss` (chosen-response NLL per token over the step, same
    ``mean_chosen_tokens``). TRL's ORPO also counts the prompt's tokens in that NLL; here the prompt
    is shared and not a target, and the paper's L_SFT is over the response only.
    """
    # at least fp32, as TRL: log1mexp near 0 is ill-conditioned in half precision
    dtype = torch.promote_types(policy_chosen_logps.dtype, torch.float32)
    avg_c = _per_token(policy_chosen_logps, chosen_lengths).to(dtype)
    avg_r = _per_token(policy_rejected_logps, rejected_lengths).to(dtype)
    log_odds = (avg_c - avg_r) - (_log1mexp(avg_c) - _log1mexp(avg_r))
    odds_term = -alpha * F.logsigmoid(log_odds)
    return sft_loss(policy_chosen_logps, chosen_lengths, mean_chosen_tokens) + odds_term.to(policy_chosen_logps.dtype)


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
        raise ValueError("reference-free rewards need lengths (response token counts)")
    return (beta * _per_token(policy_logps, lengths)).detach()
