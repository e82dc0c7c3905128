"""The loss table: one row per loss, and every fact about losses read from it.

A loss is a pure function in :mod:`prefixdpo.dpo.losses` plus one :class:`LossRow` in :data:`LOSS_TABLE`
saying how to call it and what it needs. Name resolution, the one validation of ``loss_type`` /
``loss_weights`` and of the loss options, whether a reference is needed, what the losses need of the whole
optimizer step (the pre-pass, the step context), WPO and f-divergence compatibility, and which loss an
option belongs to are all read from the rows. Add a loss with :func:`register_loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from types import SimpleNamespace

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
    "LossStep",
    "LossRow",
    "LOSS_TABLE",
    "register_loss",
    "logratios",
    "scores",
    "loss_row",
    "known_loss_names",
    "resolve_losses",
    "canonical_loss_types",
    "check_loss_options",
    "needs_reference",
    "needs_step_pairs",
    "coupled",
    "losses_reading",
]


# ---------------------------------------------------------------------------------------------
# What a loss is computed from
# ---------------------------------------------------------------------------------------------


@dataclass
class PairLogps:
    """Per-pair log-prob statistics of some pairs; every tensor is ``[P]``: the pairs one call computes losses
    for, or (detached, reference included, nothing else: :meth:`for_step`) every pair of an optimizer step, as
    the step context reads them (all micro-batches, all ranks; a pair's position is its step index).

    ``policy_*``: summed log-probs of each response's tokens (LD-DPO's length-desensitised sums when
    ``ld_alpha`` is set); ``ref_*``: the same under the reference model (``None`` without one);
    ``*_lengths``: response token counts; ``wpo_weights``: WPO's detached pair weight (only with ``use_weighting``).
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

    @property
    def num_pairs(self) -> int:
        return self.policy_chosen_logps.numel()

    def for_step(self) -> PairLogps:
        """The detached policy and reference log-probs of these pairs: what the step context reads of them
        (rows with ``step_values`` or ``running_mean``)."""
        if not self.has_reference:
            raise ValueError("the step's pairs need reference log-probs (ref_chosen_logps and ref_rejected_logps)")
        return PairLogps(
            self.policy_chosen_logps.detach(), self.policy_rejected_logps.detach(),
            self.ref_chosen_logps.detach(), self.ref_rejected_logps.detach(),
        )  # fmt: skip


@dataclass
class LossParams:
    """The loss options (TRL's names and defaults); a row lists the ones its loss reads. Each default is written
    here only: `PrefixDPOConfig`'s fields of the same names take theirs from it (``default=LossParams.beta``), and
    :meth:`from_config` reads the values back by name.

    - ``beta``: DPO beta; IPO's tau; SimPO's beta (TRL ``CPOConfig.beta``).
    - ``label_smoothing``: cDPO / robust / EXO epsilon; also AOT's and SimPO's smoothing (as in TRL).
    - ``simpo_gamma``: SimPO's target reward margin; ``orpo_alpha``: ORPO's lambda (TRL ``ORPOConfig.beta``);
      ``discopop_tau``: DiscoPOP's temperature.
    - ``f_divergence_type`` / ``f_alpha_divergence_coef``: the f-DPO score transform (TRL's names).
    - ``use_weighting``: WPO (https://arxiv.org/abs/2406.11827): every loss of a pair times
      ``w_chosen * w_rejected`` from the policy, without gradient (the inputs carry ``wpo_weights``).
    - ``ld_alpha``: LD-DPO's weight of tokens past the shorter response, applied where the log-prob sums are
      computed (``prefixdpo.dpo.step``); ``None``: off.
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

    @classmethod
    def from_config(cls, config) -> LossParams:
        """The loss options of `config` (a `PrefixDPOConfig`, or anything with these fields by name)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

F_DIVERGENCE_OPTIONS = ("f_divergence_type", "f_alpha_divergence_coef")


@dataclass(frozen=True)
class LossStep:
    """What one loss sees of the whole optimizer step (see :class:`LossRow`).

    ``mean_chosen_tokens``: the step's chosen tokens per pair (rows with ``token_mean``); ``values``: its
    row's ``step_values`` at this call's pairs, each ``[P]`` (``None`` without); ``running_mean``: its running
    mean for this step (0.0 without state, as TRL 1.16's BCO).
    """

    mean_chosen_tokens: Tensor | float = 1.0
    values: tuple[Tensor, ...] | None = None
    running_mean: float = 0.0


def logratios(x: PairLogps) -> tuple[Tensor, Tensor]:
    """``(policy - reference)`` of the chosen and of the rejected responses, each ``[P]``."""
    return x.policy_chosen_logps - x.ref_chosen_logps, x.policy_rejected_logps - x.ref_rejected_logps


def scores(x: PairLogps, options: SimpleNamespace) -> tuple[Tensor, Tensor]:
    """The log-ratios after the f-divergence transform of ``options`` (rows with ``f_divergence``), each ``[P]``."""
    return tuple(f_divergence_scores(r, options.f_divergence_type, options.f_alpha_divergence_coef)
                 for r in logratios(x))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The row
# ---------------------------------------------------------------------------------------------

Compute = Callable[[PairLogps, SimpleNamespace, LossStep], Tensor]
_LENGTHS = ("chosen_lengths", "rejected_lengths")
_OPTIONS = tuple(f.name for f in fields(LossParams))


@dataclass(frozen=True)
class LossRow:
    """One loss: how to call its function and what it needs.

    - ``compute(inputs, options, step) -> [P]``: ``inputs`` a :class:`PairLogps` ``[P]``; ``options`` holds only
      the ``options`` below (plus the f-divergence ones where ``f_divergence``); ``step`` a :class:`LossStep`.
    - ``options``: the :class:`LossParams` fields it reads.
    - ``reference``: reads reference log-probs. ``lengths``: the response-length fields of ``inputs`` it reads.
    - ``token_mean``: reads ``step.mean_chosen_tokens`` (TRL normalises the chosen NLL by the step's tokens).
    - ``step_values(step_pairs) -> tuple of [P_step]``: computed once over the step's detached pairs, read as
      ``step.values`` (AOT's quantile partners). The step's pairs are needed always.
    - ``running_mean(step_pairs, options) -> values``: folded into this loss's running mean on each training
      step before it is read as ``step.running_mean`` (BCO's delta). The step's pairs are needed when training.
    - ``f_divergence``: the f-DPO transform is defined for it (TRL's set). ``weighting``: WPO is defined for it.
    - ``aliases``: other names for it.
    """

    compute: Compute
    options: tuple[str, ...] = ("beta",)
    reference: bool = True
    lengths: tuple[str, ...] = ()
    token_mean: bool = False
    step_values: Callable[[PairLogps], tuple[Tensor, ...]] | None = None
    running_mean: Callable[[PairLogps, SimpleNamespace], Tensor] | None = None
    f_divergence: bool = False
    weighting: bool = True
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # a wrong row is the loss author's bug: ValueError, at registration
        unknown = [o for o in self.options if o not in _OPTIONS]
        if unknown:
            raise ValueError(f"LossRow options {unknown} are not LossParams fields ({', '.join(_OPTIONS)})")
        if not set(self.lengths) <= set(_LENGTHS):
            raise ValueError(f"LossRow lengths {list(self.lengths)}: choose from {', '.join(_LENGTHS)}")
        if (self.step_values or self.running_mean) and not self.reference:
            raise ValueError("LossRow with step_values or running_mean reads the step's pairs, which hold reference "
                             "log-probs")

    @property
    def coupled(self) -> bool:
        """Whether it needs anything of the whole optimizer step beyond its own pairs."""
        return self.token_mean or self.step_values is not None or self.running_mean is not None

    def needs_step_pairs(self, *, train: bool) -> bool:
        return self.step_values is not None or (train and self.running_mean is not None)

    def read_options(self, params: LossParams) -> SimpleNamespace:
        """The options ``compute`` and ``running_mean`` may read, and no others."""
        names = self.options + (F_DIVERGENCE_OPTIONS if self.f_divergence else ())
        return SimpleNamespace(**{name: getattr(params, name) for name in names})


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def _margins(x: PairLogps) -> tuple[Tensor, Tensor]:
    # AOT (paired) sorts the policy's and the reference's chosen-minus-rejected margins
    return x.policy_chosen_logps - x.policy_rejected_logps, x.ref_chosen_logps - x.ref_rejected_logps


_SMOOTHED = ("beta", "label_smoothing")

# f_divergence: the f-DPO reparameterisation leaves a beta*log Z(x) term that cancels only in the chosen-minus-
# rejected score difference, so only losses built on that difference (and sft, with no reference) take it.

LOSS_TABLE: dict[str, LossRow] = {
    "sigmoid": LossRow(lambda x, o, s: sigmoid_loss(*scores(x, o), o.beta, o.label_smoothing),
                       options=_SMOOTHED, f_divergence=True),
    "robust": LossRow(lambda x, o, s: robust_loss(*scores(x, o), o.beta, o.label_smoothing),
                      options=_SMOOTHED, f_divergence=True),
    "hinge": LossRow(lambda x, o, s: hinge_loss(*scores(x, o), o.beta), f_divergence=True),
    "ipo": LossRow(lambda x, o, s: ipo_loss(*scores(x, o), x.chosen_lengths, x.rejected_lengths, o.beta),
                   lengths=_LENGTHS, f_divergence=True),
    "sigmoid_norm": LossRow(lambda x, o, s: sigmoid_norm_loss(*scores(x, o), x.chosen_lengths, x.rejected_lengths,
                                                              o.beta),
                            lengths=_LENGTHS, f_divergence=True),
    "exo_pair": LossRow(lambda x, o, s: exo_pair_loss(*scores(x, o), o.beta, o.label_smoothing),
                        options=_SMOOTHED, f_divergence=True),
    "nca_pair": LossRow(lambda x, o, s: nca_pair_loss(*logratios(x), o.beta)),
    "bco_pair": LossRow(lambda x, o, s: bco_pair_loss(*logratios(x), o.beta, s.running_mean),
                        running_mean=lambda pairs, o: o.beta * torch.cat(logratios(pairs))),  # the step's rewards
    "sppo_hard": LossRow(lambda x, o, s: sppo_hard_loss(*logratios(x), o.beta)),
    # WPO's per-pair weights are refused for the sorted losses, as TRL does: a sort misaligns pairs and weights
    "aot": LossRow(lambda x, o, s: aot_loss(x.policy_chosen_logps, x.policy_rejected_logps, x.ref_chosen_logps,
                                            x.ref_rejected_logps, o.beta, o.label_smoothing, s.values),
                   options=_SMOOTHED, step_values=lambda pairs: quantile_partners(*_margins(pairs)), weighting=False),
    # the AOT issue calls the unpaired variant "aot_pair"; TRL calls it "aot_unpaired"
    "aot_unpaired": LossRow(lambda x, o, s: aot_unpaired_loss(*logratios(x), o.beta, o.label_smoothing, s.values),
                            options=_SMOOTHED, step_values=lambda pairs: quantile_partners(*logratios(pairs)),
                            weighting=False, aliases=("aot_pair",)),
    "apo_zero": LossRow(lambda x, o, s: apo_zero_loss(*logratios(x), o.beta)),
    "apo_down": LossRow(lambda x, o, s: apo_down_loss(*logratios(x), o.beta)),
    "discopop": LossRow(lambda x, o, s: discopop_loss(*scores(x, o), o.beta, o.discopop_tau),
                        options=("beta", "discopop_tau"), f_divergence=True),
    # TRL's sft is a scalar expanded over the pairs: its in-place WPO weighting fails, so WPO has no TRL meaning
    "sft": LossRow(lambda x, o, s: sft_loss(x.policy_chosen_logps, x.chosen_lengths, s.mean_chosen_tokens),
                   options=(), reference=False, lengths=("chosen_lengths",), token_mean=True, f_divergence=True,
                   weighting=False),
    "simpo": LossRow(lambda x, o, s: simpo_loss(x.policy_chosen_logps, x.policy_rejected_logps, x.chosen_lengths,
                                                x.rejected_lengths, o.beta, o.simpo_gamma, o.label_smoothing),
                     options=("beta", "simpo_gamma", "label_smoothing"), reference=False, lengths=_LENGTHS),
    "orpo": LossRow(lambda x, o, s: orpo_loss(x.policy_chosen_logps, x.policy_rejected_logps, x.chosen_lengths,
                                              x.rejected_lengths, o.orpo_alpha, s.mean_chosen_tokens),
                    options=("orpo_alpha",), reference=False, lengths=_LENGTHS, token_mean=True),
}  # fmt: skip


def register_loss(name: str, row: LossRow) -> None:
    """Add a loss to the table: ``loss_type`` then accepts ``name`` (and ``row.aliases``) everywhere."""
    taken = _aliases() | LOSS_TABLE.keys()
    clash = [n for n in (name, *row.aliases) if n in taken]
    if clash:
        raise ValueError(f"loss name(s) {', '.join(clash)} already in the loss table")
    LOSS_TABLE[name] = row


# ---------------------------------------------------------------------------------------------
# Facts read from the table
# ---------------------------------------------------------------------------------------------


def _aliases() -> dict[str, str]:
    return {alias: name for name, row in LOSS_TABLE.items() for alias in row.aliases}


def known_loss_names() -> list[str]:
    """Every name ``loss_type`` accepts, aliases included, sorted."""
    return sorted([*LOSS_TABLE, *_aliases()])


def _canonical(name: str) -> str:
    resolved = _aliases().get(name, name)
    if resolved not in LOSS_TABLE:
        raise LossConfigError(f"unknown loss_type {name!r}; known: {', '.join(known_loss_names())}")
    return resolved


def loss_row(name: str) -> LossRow:
    """The row of ``name`` (or of the loss it is an alias of)."""
    return LOSS_TABLE[_canonical(name)]


def _names(loss_types: Iterable[str] | str) -> list[str]:
    return [_canonical(n) for n in ([loss_types] if isinstance(loss_types, str) else loss_types)]


def resolve_losses(loss_types: Iterable[str] | str, loss_weights: Sequence[float] | None = None
                   ) -> list[tuple[str, float]]:
    """``(name, weight)`` per configured loss, aliases resolved; weights default to 1.0 each.

    The one check of ``loss_type`` / ``loss_weights``: an empty list, an unknown or repeated name, or a
    weight count that differs raise :class:`LossConfigError` (one line).
    """
    names = _names(loss_types)
    if not names:
        raise LossConfigError("loss_type is empty; give at least one loss type")
    if len(set(names)) != len(names):
        raise LossConfigError(f"loss type listed twice in {names}; merge their weights instead")
    weights = [1.0] * len(names) if loss_weights is None else list(loss_weights)
    if len(weights) != len(names):
        raise LossConfigError(
            f"loss_weights has {len(weights)} entries for {len(names)} loss types ({', '.join(names)})"
        )
    return list(zip(names, weights))


def canonical_loss_types(loss_types: Iterable[str] | str) -> list[str]:
    """The configured loss names, aliases resolved, checked as :func:`resolve_losses` checks them."""
    return [name for name, _ in resolve_losses(loss_types)]


def check_loss_options(loss_types: Iterable[str] | str, params: LossParams) -> None:
    """Refuse (one line) an f-divergence or WPO weighting that is unknown or not defined for a configured loss."""
    names = _names(loss_types)
    if params.use_weighting:
        for name in names:
            if not LOSS_TABLE[name].weighting:
                raise LossConfigError(f"use_weighting (WPO) is not defined for loss {name!r}, as in TRL 1.16")
    if params.f_divergence_type != "reverse_kl":
        if params.f_divergence_type not in F_DIVERGENCES:
            raise LossConfigError(
                f"unknown f_divergence_type {params.f_divergence_type!r}; known: {', '.join(F_DIVERGENCES)}"
            )
        defined = sorted(n for n, row in LOSS_TABLE.items() if row.f_divergence)
        for name in names:
            if name not in defined:
                raise LossConfigError(f"f_divergence_type={params.f_divergence_type!r} is only defined for "
                                      f"{', '.join(defined)}; got loss {name!r}")


def needs_reference(loss_types: Iterable[str] | str) -> bool:
    """Whether any of these losses reads reference log-probs."""
    return any(LOSS_TABLE[name].reference for name in _names(loss_types))


def needs_step_pairs(loss_types: Iterable[str] | str, *, train: bool = True) -> bool:
    """Whether the step context needs the step's pairs (:meth:`PairLogps.for_step`) for these losses: rows with
    ``step_values`` always, rows with ``running_mean`` when training (the trainer then runs a no-grad pre-pass over
    the step)."""
    return any(LOSS_TABLE[name].needs_step_pairs(train=train) for name in _names(loss_types))


def coupled(loss_types: Iterable[str] | str) -> bool:
    """Whether any of these losses needs something of the whole optimizer step (a step context)."""
    return any(LOSS_TABLE[name].coupled for name in _names(loss_types))


def losses_reading(option: str) -> list[str]:
    """The losses whose rows read the :class:`LossParams` field ``option``, sorted."""
    return sorted(name for name, row in LOSS_TABLE.items() if option in row.options)
