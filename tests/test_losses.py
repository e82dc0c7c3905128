"""Tests for prefixdpo.dpo.losses (pure loss functions), prefixdpo.dpo.loss_table (the rows) and
prefixdpo.dpo.step (combined_loss) and prefixdpo.dpo.coupling (the step context).

Two kinds of reference values:

1. TRL's own code on the same tensors. ``DPOTrainer._compute_loss`` is a method, not a function, so
   it is called unbound with a stub ``self`` (the attributes it reads) and a stub model whose output
   carries per-token log-probs; reference log-probs go in precomputed, as TRL's
   ``precompute_ref_log_probs`` path does. SimPO uses ``CPOTrainer.cpo_loss`` and ORPO
   ``ORPOTrainer.odds_ratio_loss`` the same way. Values and gradients (w.r.t. the per-token
   log-probs) must agree to fp32 rounding (`tolerances`: values within K_FORWARD eps of `loss_scale`,
   gradients within K eps of their largest entry).
2. Hand-computed values: formulas written out in plain ``math`` on scalars, independent of both
   TRL and our torch code, for a few losses and for what TRL 1.16 does not have (cDPO smoothing,
   BCO's running mean, the alias name).
3. Step splits: every loss is defined on the whole optimizer step's pairs; splitting the step into
   micro-batches (and simulated ranks) with ``build_step_context(...).local(indices)`` must give the
   one-batch value and gradients (float64, the same rule with float64's eps), and TRL's one-batch formula
   where TRL has it.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from prefixdpo.errors import ConfigError, UserError
from prefixdpo.dpo.loss_table import LOSS_TABLE, LossParams, PairLogps, needs_step_pairs
from prefixdpo.dpo.coupling import RunningMean, StepContext, build_step_context
from prefixdpo.dpo.losses import LossConfigError, rewards
from prefixdpo.dpo.step import combined_loss
from tolerances import K_FORWARD, assert_within

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
DPOTrainer = trl_dpo.DPOTrainer

P, T = 6, 9  # pairs, max response length


def loss_scale(values: torch.Tensor, inputs) -> float:
    """The rounding scale of loss values [N] (or one) computed from `inputs` (tensors that require grad): the
    largest over values of |v| + 2 x sum_i |dv/dx_i| |x_i|, the first-order reach of intermediates as large as the
    inputs (a margin from ~20-nat sums carries their rounding, not the loss's own size's; x 2: the reference sums,
    which take no gradient here, enter as the policy's do)."""
    out = 0.0
    for v in values.reshape(-1):
        grads = torch.autograd.grad(v, inputs, retain_graph=True, allow_unused=True, materialize_grads=True)
        out = max(out, abs(v.item()) + 2 * sum((g * x).abs().sum().item() for g, x in zip(grads, inputs)))
    return out


def assert_loss_within(got, want, got_grad, want_grad, inputs, dtype=torch.float32, what="") -> None:
    """`got` against `want` within K_FORWARD eps of `loss_scale(want, inputs)`, their gradients within K eps of
    the largest entry of `want_grad`."""
    assert_within(got.detach(), want.detach(), loss_scale(want, inputs), dtype, K_FORWARD, f"{what} value")
    assert_within(got_grad, want_grad, want_grad.abs().max().item(), dtype, what=f"{what} gradient")


@contextlib.contextmanager
def _caller_bug(match: str):
    """A wrong argument from the trainer (not an option): a ValueError that is NOT a UserError, so the
    command line keeps its traceback instead of printing it as the user's mistake."""
    with pytest.raises(ValueError, match=match) as info:
        yield
    assert not isinstance(info.value, UserError), type(info.value)


def pair_rewards(inputs: PairLogps, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)`` implicit rewards ``[P]``: with a reference if ``inputs`` has one, else per token."""
    if inputs.has_reference:
        return (rewards(inputs.policy_chosen_logps, inputs.ref_chosen_logps, beta),
                rewards(inputs.policy_rejected_logps, inputs.ref_rejected_logps, beta))
    return (rewards(inputs.policy_chosen_logps, None, beta, inputs.chosen_lengths),
            rewards(inputs.policy_rejected_logps, None, beta, inputs.rejected_lengths))


STEP_FIELDS = ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps")


def cat_step_pairs(parts: list[PairLogps]) -> PairLogps:
    """Micro-batches' (or ranks') step pairs (`PairLogps.for_step`) concatenated in step-index order, as the trainer
    gathers them."""
    return PairLogps(*(torch.cat([getattr(p, name) for p in parts]) for name in STEP_FIELDS))


# ---------------------------------------------------------------------------------------------
# A batch in TRL's layout: rows [chosen_0..P-1, rejected_0..P-1], per-token log-probs zero off mask
# ---------------------------------------------------------------------------------------------


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (2 * P,), generator=g)
    lengths[0], lengths[P] = T, 1  # a full-length chosen, a one-token rejected
    shift_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # [2P, T]
    per_token = -(0.2 + 2.0 * torch.rand(2 * P, T, generator=g)) * shift_mask
    per_token.requires_grad_(True)
    # reference = policy plus noise, so log-ratios are O(1)-O(5) as in training
    ref = (per_token.detach().sum(1) + 2.0 * torch.randn(2 * P, generator=g)).float()
    return SimpleNamespace(lengths=lengths, shift_mask=shift_mask, per_token=per_token, ref=ref)


def _ours_inputs(b, with_ref: bool = True) -> PairLogps:
    sums = b.per_token.sum(dim=1)
    return PairLogps(
        policy_chosen_logps=sums[:P],
        policy_rejected_logps=sums[P:],
        ref_chosen_logps=b.ref[:P] if with_ref else None,
        ref_rejected_logps=b.ref[P:] if with_ref else None,
        chosen_lengths=b.lengths[:P],
        rejected_lengths=b.lengths[P:],
    )


def _trl_dpo_loss(b, loss_types, loss_weights=None, p: LossParams = LossParams()) -> torch.Tensor:
    """TRL 1.16's DPOTrainer._compute_loss on batch ``b`` (scalar: sum_k w_k * mean_pairs(loss_k)).

    ``b.per_token`` ``[2P, T]`` (rows: chosen_0..P-1, rejected_0..P-1), ``b.shift_mask`` ``[2P, T]``,
    ``b.ref`` ``[2P]``.
    """
    n_rows, n_tok = b.per_token.shape
    outputs = SimpleNamespace(
        log_probs=b.per_token,
        entropy=torch.zeros(n_rows, n_tok),
        mean_logits=torch.zeros(n_rows, n_tok),
        is_top1=torch.zeros(n_rows, n_tok, dtype=torch.bool),
    )
    model = SimpleNamespace(training=True)
    model_call = lambda **kw: outputs  # noqa: E731
    stub = SimpleNamespace(
        model=model,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type=p.f_divergence_type,
        f_alpha_divergence_coef=p.f_alpha_divergence_coef,
        loss_types=list(loss_types),
        loss_weights=loss_weights or [1.0] * len(loss_types),
        beta=p.beta,
        label_smoothing=p.label_smoothing,
        use_weighting=False,
        args=SimpleNamespace(discopop_tau=p.discopop_tau),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    # completion_mask covers input_ids: one prompt token, then the response
    completion_mask = torch.cat([torch.zeros(n_rows, 1, dtype=torch.long), b.shift_mask], dim=1)
    inputs = {
        "input_ids": torch.zeros(n_rows, n_tok + 1, dtype=torch.long),
        "attention_mask": torch.ones(n_rows, n_tok + 1, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": b.ref[: n_rows // 2],
        "ref_rejected_logps": b.ref[n_rows // 2 :],
    }
    return DPOTrainer._compute_loss(stub, model_call, inputs, return_outputs=False)


def _assert_matches_trl(loss_types, loss_weights=None, p: LossParams = LossParams(), seed: int = 0):
    b = _batch(seed)
    want = _trl_dpo_loss(b, loss_types, loss_weights, p)
    (want_grad,) = torch.autograd.grad(want, b.per_token, retain_graph=True)  # kept for `loss_scale`
    got, _ = combined_loss(loss_types, loss_weights, _ours_inputs(b), p)
    got = got.mean()
    (got_grad,) = torch.autograd.grad(got, b.per_token)
    assert torch.isfinite(want) and want.abs() > 1e-4, "degenerate reference value"
    # off-mask entries are padding (TRL's sft masks them, its sums do not), so compare real tokens only
    assert_loss_within(got, want, got_grad * b.shift_mask, want_grad * b.shift_mask, [b.per_token],
                       what=" + ".join(loss_types))
    assert got_grad.abs().sum() > 0


TRL_TYPES = [
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
    "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 1. Against TRL's code
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", TRL_TYPES)
def test_each_loss_matches_trl(loss_type):
    # sigmoid: TRL 1.16 ignores label_smoothing (cDPO is tested by hand below)
    smoothing = 0.0 if loss_type == "sigmoid" else 0.1
    _assert_matches_trl([loss_type], p=LossParams(beta=0.1, label_smoothing=smoothing))


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "discopop", "apo_zero"])
def test_other_beta_matches_trl(loss_type):
    _assert_matches_trl([loss_type], p=LossParams(beta=0.5, discopop_tau=0.2), seed=1)


@pytest.mark.parametrize("fdiv", ["forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "robust", "sft"])
def test_f_divergence_matches_trl(fdiv, loss_type):
    smoothing = 0.0 if loss_type == "sigmoid" else 0.1  # TRL 1.16's sigmoid has no smoothing
    p = LossParams(f_divergence_type=fdiv, label_smoothing=smoothing, f_alpha_divergence_coef=0.3)
    _assert_matches_trl([loss_type], p=p)


def test_weighted_combination_matches_trl():
    # MPO-style mix, weights as in TRL's docs
    _assert_matches_trl(["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], seed=2)


def test_simpo_matches_trl_cpo():
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    b = _batch(4)
    x = _ours_inputs(b, with_ref=False)
    p = LossParams(beta=2.0, simpo_gamma=1.0, label_smoothing=0.05)
    stub = SimpleNamespace(
        alpha=0.0, loss_type="simpo", beta=p.beta, simpo_gamma=p.simpo_gamma,
        label_smoothing=p.label_smoothing, accelerator=SimpleNamespace(device=torch.device("cpu")),
    )  # fmt: skip
    avg_c = x.policy_chosen_logps / x.chosen_lengths
    avg_r = x.policy_rejected_logps / x.rejected_lengths
    want, want_rc, want_rr = cpo.CPOTrainer.cpo_loss(stub, avg_c, avg_r)
    got, per_type = combined_loss(["simpo"], None, x, p)
    g_want = torch.autograd.grad(want.sum(), b.per_token, retain_graph=True)[0]
    g_got = torch.autograd.grad(got.sum(), b.per_token, retain_graph=True)[0]
    assert_loss_within(got, want, g_got, g_want, [b.per_token], what="simpo")
    # TRL's CPO logs beta * average log-prob as the reward: ours without a reference does the same
    rc, rr = pair_rewards(x, p.beta)
    scale = p.beta * max(avg_c.abs().max().item(), avg_r.abs().max().item())  # beta x the averages' size
    assert_within(rc, want_rc, scale, k=K_FORWARD, what="chosen rewards")
    assert_within(rr, want_rr, scale, k=K_FORWARD, what="rejected rewards")


def test_orpo_matches_trl_odds_ratio_plus_response_nll():
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    b = _batch(5)
    x = _ours_inputs(b, with_ref=False)
    p = LossParams(orpo_alpha=0.25)
    stub = SimpleNamespace(beta=p.orpo_alpha, accelerator=SimpleNamespace(device=torch.device("cpu")))
    avg_c = x.policy_chosen_logps / x.chosen_lengths
    avg_r = x.policy_rejected_logps / x.rejected_lengths
    odds_terms = orpo.ORPOTrainer.odds_ratio_loss(stub, avg_c, avg_r)[0]
    # TRL ORPO: loss = NLL - mean(beta * logsigmoid(log_odds)); our NLL is TRL DPO's `sft` (response only)
    want = _trl_dpo_loss(b, ["sft"]) - odds_terms.mean()
    got = combined_loss(["orpo"], None, x, p)[0].mean()
    g_want = torch.autograd.grad(want, b.per_token, retain_graph=True)[0] * b.shift_mask
    g_got = torch.autograd.grad(got, b.per_token, retain_graph=True)[0] * b.shift_mask
    assert_loss_within(got, want, g_got, g_want, [b.per_token], what="orpo")


# ---------------------------------------------------------------------------------------------
# 2. Hand-computed values (plain math, scalars)
# ---------------------------------------------------------------------------------------------

# two pairs: (policy_c, policy_r, ref_c, ref_r, len_c, len_r)
HAND = [(-10.0, -15.0, -12.0, -13.0, 4, 5), (-7.0, -6.0, -7.5, -5.0, 2, 3)]


def _hand_inputs(with_ref=True) -> PairLogps:
    col = lambda i: torch.tensor([row[i] for row in HAND], dtype=torch.float64)  # noqa: E731
    return PairLogps(
        col(0), col(1), col(2) if with_ref else None, col(3) if with_ref else None,
        col(4).long(), col(5).long(),
    )  # fmt: skip


def _logsig(z: float) -> float:
    return -math.log1p(math.exp(-z)) if z > 0 else z - math.log1p(math.exp(z))


def test_hand_values_dpo_cdpo_ipo_hinge():
    beta, eps = 0.1, 0.2
    p = LossParams(beta=beta, label_smoothing=eps)
    out = {n: combined_loss([n], None, _hand_inputs(), p)[0].tolist() for n in ["sigmoid", "ipo", "hinge"]}
    for i, (pc, pr, rc, rr, lc, lr) in enumerate(HAND):
        d = (pc - rc) - (pr - rr)
        assert out["sigmoid"][i] == pytest.approx(-(1 - eps) * _logsig(beta * d) - eps * _logsig(-beta * d), rel=1e-12)
        assert out["ipo"][i] == pytest.approx(((pc - rc) / lc - (pr - rr) / lr - 1 / (2 * beta)) ** 2, rel=1e-12)
        assert out["hinge"][i] == pytest.approx(max(0.0, 1 - beta * d), abs=1e-12)
    # first pair: d = 2 - (-2) = 4, plain DPO loss = log(1 + e^-0.4)
    plain = combined_loss(["sigmoid"], None, _hand_inputs(), LossParams(beta=0.1))[0]
    assert plain[0].item() == pytest.approx(0.5130152523999526, rel=1e-12)


def test_hand_values_simpo_orpo_sft():
    beta, gamma, lam = 2.0, 0.5, 0.1
    p = LossParams(beta=beta, simpo_gamma=gamma, orpo_alpha=lam)
    x = _hand_inputs(with_ref=False)
    simpo = combined_loss(["simpo"], None, x, p)[0].tolist()
    orpo = combined_loss(["orpo"], None, x, p)[0].tolist()
    sft = combined_loss(["sft"], None, x, p)[0].tolist()
    nll = -sum(r[0] for r in HAND) / sum(r[4] for r in HAND)  # per token over the batch
    mean_tokens = sum(r[4] for r in HAND) / len(HAND)
    odds = []
    for i, (pc, pr, _, _, lc, lr) in enumerate(HAND):
        ac, ar = pc / lc, pr / lr
        assert simpo[i] == pytest.approx(-_logsig(beta * (ac - ar) - gamma), rel=1e-12)
        log_odds = (ac - math.log(1 - math.exp(ac))) - (ar - math.log(1 - math.exp(ar)))
        odds.append(-lam * _logsig(log_odds))
        # pair i's share of the batch's token-mean NLL: its own NLL over the batch's mean length
        assert sft[i] == pytest.approx(-pc / mean_tokens, rel=1e-12)
        assert orpo[i] == pytest.approx(-pc / mean_tokens + odds[i], rel=1e-12)
    # the per-pair shares average to TRL's batch scalars
    assert sum(sft) / len(HAND) == pytest.approx(nll, rel=1e-12)
    assert sum(orpo) / len(HAND) == pytest.approx(nll + sum(odds) / len(HAND), rel=1e-12)


def test_bco_running_mean_by_hand():
    beta = 0.5
    state = RunningMean()
    x = _hand_inputs()
    rewards_seen = []
    for step in range(2):
        # each call is one whole training step: its context folds its rewards into the mean first
        context = build_step_context(["bco_pair"], LossParams(beta=beta), x.for_step(), num_pairs=2,
                                     chosen_tokens=None, running={"bco_pair": state}, train=True)
        got = combined_loss(["bco_pair"], None, x, LossParams(beta=beta), context)[0].tolist()
        rewards_seen += [beta * (r[0] - r[2]) for r in HAND] + [beta * (r[1] - r[3]) for r in HAND]
        delta = sum(rewards_seen) / len(rewards_seen)  # mean of all rewards so far, this batch included
        assert state.mean == pytest.approx(delta, rel=1e-12) and state.count == 4 * (step + 1)
        for i, (pc, pr, rc, rr, _, _) in enumerate(HAND):
            want = -_logsig(beta * (pc - rc) - delta) - _logsig(-(beta * (pr - rr) - delta))
            assert got[i] == pytest.approx(want, rel=1e-12)
    restored = RunningMean()
    restored.load_state_dict(state.state_dict())
    assert restored == state


def test_aot_pair_is_alias_of_aot_unpaired():
    x, p = _hand_inputs(), LossParams(label_smoothing=0.1)
    a, per_a = combined_loss(["aot_pair"], None, x, p)
    b, _ = combined_loss(["aot_unpaired"], None, x, p)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert list(per_a) == ["aot_unpaired"]


# ---------------------------------------------------------------------------------------------
# 3. Combination, gradients, rewards, errors
# ---------------------------------------------------------------------------------------------


def _all_types_inputs():
    b = _batch(6)
    x = _ours_inputs(b)
    return b, x


@pytest.mark.parametrize("loss_type", sorted(LOSS_TABLE))
def test_gradients_finite_and_nonzero(loss_type):
    b, x = _all_types_inputs()
    loss, _ = combined_loss([loss_type], None, x, LossParams(label_smoothing=0.1))
    assert loss.shape == (P,)
    (grad,) = torch.autograd.grad(loss.sum(), b.per_token)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "nca_pair", "bco_pair", "aot", "simpo"])
def test_logistic_losses_stable_at_extreme_margins(loss_type):
    pc = torch.tensor([-1.0, -5000.0], requires_grad=True)
    pr = torch.tensor([-5000.0, -1.0], requires_grad=True)
    ref = torch.tensor([-100.0, -100.0])
    x = PairLogps(pc, pr, ref, ref, torch.tensor([10, 10]), torch.tensor([10, 10]))
    loss, _ = combined_loss([loss_type], None, x, LossParams(label_smoothing=0.1))
    grads = torch.autograd.grad(loss.sum(), [pc, pr])
    assert torch.isfinite(loss).all() and all(torch.isfinite(g).all() for g in grads)


def test_weighted_sum_equals_sum_of_weighted_parts():
    b, x = _all_types_inputs()
    names, weights = ["sigmoid", "sft", "apo_zero", "simpo"], [0.7, 0.3, 2.0, 0.5]
    total, per_type = combined_loss(names, weights, x, LossParams())
    assert list(per_type) == names
    manual = sum(w * combined_loss([n], None, x, LossParams())[0] for n, w in zip(names, weights))
    # the same terms summed in another order: within the rounding of the weighted terms' sizes
    scale = sum(w * loss_scale(per_type[n], [b.per_token]) for n, w in zip(names, weights))
    assert_within(total.detach(), manual.detach(), scale, k=K_FORWARD, what="weighted sum vs parts")
    assert_within(total.detach(), sum(w * per_type[n] for n, w in zip(names, weights)).detach(), scale, k=K_FORWARD,
                  what="weighted sum vs logged parts")


def test_rewards():
    x = _hand_inputs()
    rc = rewards(x.policy_chosen_logps, x.ref_chosen_logps, 0.1)
    assert rc.tolist() == pytest.approx([0.1 * 2.0, 0.1 * 0.5], rel=1e-12)
    assert not rc.requires_grad
    free = rewards(x.policy_chosen_logps, None, 2.0, x.chosen_lengths)
    assert free.tolist() == pytest.approx([2.0 * -10.0 / 4, 2.0 * -7.0 / 2], rel=1e-12)
    chosen, rejected = pair_rewards(x, 0.1)
    assert rejected.tolist() == pytest.approx([0.1 * -2.0, 0.1 * -1.0], rel=1e-12)
    with _caller_bug("lengths"):
        rewards(x.policy_chosen_logps, None, 0.1)


def test_losses_without_a_reference():
    assert {name for name, row in LOSS_TABLE.items() if not row.reference} == {"simpo", "orpo", "sft"}
    for name in ["simpo", "orpo", "sft"]:
        combined_loss([name], None, _hand_inputs(with_ref=False), LossParams())  # no error


def test_errors():
    x, no_ref = _hand_inputs(), _hand_inputs(with_ref=False)
    # Options the user gave: a ConfigError (one line, exit 2 on the command line).
    assert issubclass(LossConfigError, ConfigError)
    with pytest.raises(ConfigError, match=r"unknown loss_type 'dpo'; known: .*sigmoid.*simpo"):
        combined_loss(["dpo"], None, x, LossParams())
    with pytest.raises(ConfigError, match=r"loss_weights has 1 entries for 2 loss types \(sigmoid, sft\)"):
        combined_loss(["sigmoid", "sft"], [1.0], x, LossParams())
    with pytest.raises(ConfigError, match="only defined for"):
        combined_loss(["nca_pair"], None, x, LossParams(f_divergence_type="forward_kl"))
    with pytest.raises(ConfigError, match="unknown f_divergence_type"):
        combined_loss(["sigmoid"], None, x, LossParams(f_divergence_type="kl"))
    with pytest.raises(ConfigError, match="label_smoothing"):
        combined_loss(["exo_pair"], None, x, LossParams(label_smoothing=0.0))
    with pytest.raises(ConfigError, match="label_smoothing"):
        combined_loss(["robust"], None, x, LossParams(label_smoothing=0.5))
    with pytest.raises(ConfigError, match="empty"):
        combined_loss([], None, x, LossParams())
    # Inputs the trainer supplies: missing ones are a bug, not the user's mistake.
    with _caller_bug("needs reference log-probs"):
        combined_loss(["sigmoid"], None, no_ref, LossParams())
    no_len = PairLogps(x.policy_chosen_logps, x.policy_rejected_logps, x.ref_chosen_logps, x.ref_rejected_logps)
    with _caller_bug("'ipo' needs chosen_lengths"):
        combined_loss(["ipo"], None, no_len, LossParams())



# ---------------------------------------------------------------------------------------------
# 4. Losses on the whole optimizer step: any split into micro-batches and ranks gives the same
#    value and gradients as one batch (and as TRL 1.16's one-batch formula)
# ---------------------------------------------------------------------------------------------

STEP = 8  # pairs in the simulated optimizer step
F64 = torch.float64  # the step-split checks: float64, the rule of `tolerances` with float64's eps

# Each split: per rank, the micro-batches' pair ids (of the step's 8). The trainer's step order
# (PairLogps.for_step) is rank by rank, micro-batch by micro-batch, so the step indices are positions there.
SPLITS = {
    "3+5": [[[0, 1, 2], [3, 4, 5, 6, 7]]],
    "1+2+5": [[[5], [0, 7], [1, 2, 3, 4, 6]]],
    "8 shuffled": [[[3, 7, 0, 5, 1, 6, 2, 4]]],
    "2 ranks, 1+3 and 2+2": [[[6], [0, 4, 2]], [[3, 1], [7, 5]]],
}

STEP_COMBOS = {
    **{name: ([name], None) for name in sorted(LOSS_TABLE)},
    "rpo (sigmoid + 0.5 sft)": (["sigmoid", "sft"], [1.0, 0.5]),
    "mpo (sigmoid, bco_pair, sft)": (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]),
    "all coupled": (["aot", "aot_unpaired", "sft", "bco_pair"], [0.5, 1.5, 0.3, 1.0]),
    "orpo + simpo": (["orpo", "simpo"], [1.0, 0.7]),
}
COUPLED = {"sft", "orpo", "aot", "aot_unpaired"}  # bco_pair is coupled only through its running mean


def _step_leaves(seed: int):
    """Random float64 per-pair inputs of one step, as leaves: (pc, pr, rc, rr) each [STEP], lengths [STEP]."""
    g = torch.Generator().manual_seed(seed)
    lc = torch.randint(1, 20, (STEP,), generator=g)
    lr = torch.randint(1, 20, (STEP,), generator=g)
    pc = -lc * (0.3 + 1.5 * torch.rand(STEP, generator=g, dtype=torch.float64))
    pr = -lr * (0.3 + 1.5 * torch.rand(STEP, generator=g, dtype=torch.float64))
    rc = pc + 5.0 * torch.randn(STEP, generator=g, dtype=torch.float64)
    rr = pr + 5.0 * torch.randn(STEP, generator=g, dtype=torch.float64)
    # reference leaves take gradients too, so both sides of the sorted AOT pairings are checked
    leaves = [t.clone().requires_grad_(True) for t in (pc, pr, rc, rr)]
    return leaves, lc, lr


def _pairs(leaves, lc, lr, ids=None) -> PairLogps:
    pick = (lambda t: t) if ids is None else (lambda t: t[torch.tensor(ids)])  # noqa: E731
    pc, pr, rc, rr = leaves
    return PairLogps(pick(pc), pick(pr), pick(rc), pick(rr), pick(lc), pick(lr))


def _split_loss(names, weights, p, leaves, lc, lr, split, running=None, train=False) -> torch.Tensor:
    """The trainer's computation: one context per step, then sum over ranks and micro-batches of
    sum(per-pair losses) / STEP."""
    groups = [ids for rank in split for ids in rank]
    step_pairs = cat_step_pairs([_pairs(leaves, lc, lr, ids).for_step() for ids in groups])
    context = build_step_context(names, p, step_pairs, num_pairs=STEP, chosen_tokens=int(lc.sum()),
                                 running=running, train=train)
    total, offset = 0.0, 0
    for ids in groups:
        local = context.local(torch.arange(offset, offset + len(ids)))
        offset += len(ids)
        losses, _ = combined_loss(names, weights, _pairs(leaves, lc, lr, ids), p, local)
        total = total + losses.sum() / STEP
    return total


def _trl_on_pairs(names, weights, p, leaves, lc, lr) -> torch.Tensor:
    """TRL 1.16's one-batch loss on these per-pair sums: each response's log-prob spread evenly over
    its tokens (TRL only sums them, and its sft takes their token mean)."""
    pc, pr, rc, rr = leaves
    lengths = torch.cat([lc, lr])
    mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()
    per_token = (torch.cat([pc, pr]) / lengths)[:, None] * mask
    b = SimpleNamespace(per_token=per_token, shift_mask=mask, ref=torch.cat([rc, rr]))
    return _trl_dpo_loss(b, names, weights, p)


def _grads(value, leaves):
    return torch.autograd.grad(value, leaves, retain_graph=True, allow_unused=True, materialize_grads=True)


def _assert_same_step_loss(got, want, leaves, what: str, dtype: torch.dtype = F64) -> None:
    """A float64 step loss and its gradients (w.r.t. the four leaves) against `want`'s, as `assert_loss_within`
    (dtype: whose rounding `want` carries)."""
    g_got, g_want = (torch.cat([g.flatten() for g in _grads(v, leaves)]) for v in (got, want))
    assert_within(got.detach(), want.detach(), loss_scale(want, leaves), dtype, K_FORWARD, f"{what} value")
    assert_within(g_got, g_want, g_want.abs().max().item(), dtype, what=f"{what} gradient")


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("combo", list(STEP_COMBOS))
def test_step_split_equals_one_batch_and_trl(combo, split):
    names, weights = STEP_COMBOS[combo]
    # TRL 1.16's sigmoid ignores label_smoothing; exo_pair needs it > 0
    p = LossParams(beta=0.3, label_smoothing=0.0 if "sigmoid" in names else 0.1)
    leaves, lc, lr = _step_leaves(seed=11)

    one_batch = combined_loss(names, weights, _pairs(leaves, lc, lr), p)[0].mean()
    got = _split_loss(names, weights, p, leaves, lc, lr, SPLITS[split])
    _assert_same_step_loss(got, one_batch, leaves, "one batch")

    if set(names) <= set(TRL_TYPES):
        # TRL 1.16's exo_pair makes its constants log(1 - eps), log(eps) from a float32 tensor of label_smoothing
        trl_dtype = torch.float32 if "exo_pair" in names else F64
        _assert_same_step_loss(got, _trl_on_pairs(names, weights, p, leaves, lc, lr), leaves, "TRL", trl_dtype)

    if COUPLED & set(names) and split == "1+2+5":
        # the test can fail: each micro-batch treated as its own step (the old behaviour) differs
        naive = sum(combined_loss(names, weights, _pairs(leaves, lc, lr, ids), p)[0].sum() / STEP
                    for ids in SPLITS[split][0])
        assert abs((naive - one_batch).item()) > 1e-4 * abs(one_batch.item())


@pytest.mark.parametrize("split", list(SPLITS))
def test_bco_running_mean_split_equals_one_batch(split):
    beta = 0.3
    p = LossParams(beta=beta)
    leaves, lc, lr = _step_leaves(seed=12)
    prior = RunningMean(mean=0.4, count=48)  # earlier training steps
    split_state, one_state = RunningMean(**vars(prior)), RunningMean(**vars(prior))
    got = _split_loss(["bco_pair"], None, p, leaves, lc, lr, SPLITS[split], running={"bco_pair": split_state},
                      train=True)

    pc, pr, rc, rr = leaves
    step_rewards = beta * torch.cat([pc - rc, pr - rr]).detach()
    delta = (prior.mean * prior.count + float(step_rewards.sum())) / (prior.count + 2 * STEP)
    assert split_state.count == prior.count + 2 * STEP  # the whole step's rewards, once
    assert split_state.mean == pytest.approx(delta, rel=1e-12)
    # BCO with delta, written out (TRL < 1.0's formula)
    want = (-torch.nn.functional.logsigmoid(beta * (pc - rc) - delta)
            - torch.nn.functional.logsigmoid(-(beta * (pr - rr) - delta))).mean()
    one = combined_loss(["bco_pair"], None, _pairs(leaves, lc, lr), p, build_step_context(
        ["bco_pair"], p, _pairs(leaves, lc, lr).for_step(), num_pairs=STEP, chosen_tokens=None,
        running={"bco_pair": one_state}, train=True))[0].mean()  # fmt: skip
    for name, value in (("split", got), ("one batch", one)):
        _assert_same_step_loss(value, want, leaves, name)


def _bco_train_losses(state: RunningMean, seeds, eval_between: bool = False) -> list[float]:
    p = LossParams(beta=0.3)
    out = []
    for seed in seeds:
        leaves, lc, lr = _step_leaves(seed)
        x = _pairs(leaves, lc, lr)
        context = build_step_context(["bco_pair"], p, x.for_step(), num_pairs=STEP, chosen_tokens=None,
                                     running={"bco_pair": state}, train=True)
        out.append(combined_loss(["bco_pair"], None, x, p, context)[0].mean().item())
        if eval_between:  # evaluation reads the mean, never moves it
            before = state.state_dict()
            ev = build_step_context(["bco_pair"], p, x.for_step(), num_pairs=STEP, chosen_tokens=None,
                                    running={"bco_pair": state}, train=False)
            assert state.state_dict() == before and ev.running_means["bco_pair"] == before["mean"]
    return out


def test_bco_resumed_state_gives_the_same_losses_and_eval_does_not_move_it():
    seeds = [20, 21, 22, 23]
    uninterrupted = _bco_train_losses(RunningMean(), seeds)
    first = RunningMean()
    head = _bco_train_losses(first, seeds[:2], eval_between=True)
    saved = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = RunningMean()
    resumed.load_state_dict(saved)
    tail = _bco_train_losses(resumed, seeds[2:], eval_between=True)
    assert head + tail == uninterrupted  # bit-identical
    assert resumed.count == len(seeds) * 2 * STEP
    # the state matters: a fresh mean at step 3 gives other losses
    assert _bco_train_losses(RunningMean(), seeds[2:]) != uninterrupted[2:]


def test_quantile_partners_by_hand():
    from prefixdpo.dpo.losses import quantile_partners

    a = torch.tensor([0.5, -1.0, 2.0])  # ranks 1, 0, 2
    b = torch.tensor([10.0, 30.0, 20.0])  # ranks 0, 2, 1; sorted 10, 20, 30
    b_at_a, a_at_b = quantile_partners(a, b)
    assert b_at_a.tolist() == [20.0, 10.0, 30.0]
    assert a_at_b.tolist() == [-1.0, 2.0, 0.5]  # sorted a: -1, 0.5, 2


def test_needs_step_pairs():
    assert not needs_step_pairs(["sigmoid", "sft", "orpo", "ipo"])
    assert needs_step_pairs(["sigmoid", "aot"]) and needs_step_pairs("aot_pair", train=False)
    assert needs_step_pairs(["bco_pair"], train=True) and not needs_step_pairs(["bco_pair"], train=False)


def test_step_context_errors():
    leaves, lc, lr = _step_leaves(seed=13)
    x = _pairs(leaves, lc, lr)
    p = LossParams()
    with _caller_bug("aot need step_pairs"):
        build_step_context(["aot"], p, None, num_pairs=STEP, chosen_tokens=None, running=None, train=True)
    with _caller_bug("bco_pair need step_pairs"):
        build_step_context(["bco_pair"], p, None, num_pairs=STEP, chosen_tokens=None,
                           running={"bco_pair": RunningMean()}, train=True)
    with _caller_bug("holds 8 pairs but num_pairs=16"):
        build_step_context(["aot"], p, x.for_step(), num_pairs=16, chosen_tokens=None, running=None, train=True)
    with _caller_bug("sft need chosen_tokens"):
        build_step_context(["sft"], p, None, num_pairs=STEP, chosen_tokens=None, running=None, train=True)
    context = build_step_context(["aot"], p, x.for_step(), num_pairs=STEP, chosen_tokens=None, running=None,
                                 train=True)
    with _caller_bug(r"context holds 8 pairs but inputs hold 3: pass context.local"):
        combined_loss(["aot"], None, _pairs(leaves, lc, lr, [0, 1, 2]), p, context)
    with pytest.raises(TypeError, match="StepContext"):
        combined_loss(["bco_pair"], None, x, p, RunningMean())
    with _caller_bug("need reference"):
        PairLogps(x.policy_chosen_logps, x.policy_rejected_logps).for_step()
    assert isinstance(context.local(torch.tensor([2, 0])), StepContext)


def test_gathered_float64_context_keeps_the_inputs_dtype():
    # the trainer gathers step pairs in float64 on the host; a float32 micro-batch stays float32
    leaves, lc, lr = _step_leaves(seed=14)
    x = _pairs([t.detach().float() for t in leaves], lc, lr)
    p = LossParams(label_smoothing=0.1)
    names = ["aot", "aot_unpaired", "sft"]
    context = build_step_context(names, p, _pairs(leaves, lc, lr).for_step(), num_pairs=STEP,
                                 chosen_tokens=float(lc.sum()), running=None, train=True)
    got, per_type = combined_loss(names, None, x, p, context.local(torch.arange(STEP)))
    assert got.dtype == torch.float32 and all(v.dtype == torch.float32 for v in per_type.values())
    scale = loss_scale(combined_loss(names, None, _pairs(leaves, lc, lr), p)[0], leaves)  # the same math in float64
    assert_within(got, combined_loss(names, None, x, p)[0], scale, k=K_FORWARD, what="float32 losses")


# ---------------------------------------------------------------------------------------------
# WPO weighting (TRL's use_weighting)
# ---------------------------------------------------------------------------------------------


def _wpo_inputs(P=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = [-(torch.rand(P, generator=g, dtype=torch.float64) * 20 + 1) for _ in range(4)]
    lengths = torch.randint(1, 9, (2, P), generator=g).double()
    weights = torch.rand(P, generator=g, dtype=torch.float64) * 0.5 + 0.1
    return PairLogps(*logps, chosen_lengths=lengths[0], rejected_lengths=lengths[1], wpo_weights=weights)


def test_use_weighting_scales_every_loss_of_a_pair_by_its_weight():
    """TRL: per_sequence_loss *= w_chosen * w_rejected for each loss type, then weighted and summed."""
    from dataclasses import replace

    inputs = _wpo_inputs()
    names, weights = ["sigmoid", "ipo", "bco_pair"], [1.0, 0.3, 2.0]
    plain, plain_parts = combined_loss(names, weights, inputs, LossParams())
    weighted, parts = combined_loss(names, weights, inputs, LossParams(use_weighting=True))
    w = inputs.wpo_weights
    assert torch.allclose(weighted, plain * w, rtol=1e-12, atol=0)
    for name in names:
        assert torch.allclose(parts[name], plain_parts[name] * w, rtol=1e-12, atol=0)
    # the weight is a constant: the gradient of the weighted loss is w x the plain one
    x = replace(inputs, policy_chosen_logps=inputs.policy_chosen_logps.clone().requires_grad_())
    (g_w,) = torch.autograd.grad(combined_loss(names, weights, x, LossParams(use_weighting=True))[0].sum(),
                                 x.policy_chosen_logps)
    (g_p,) = torch.autograd.grad(combined_loss(names, weights, x, LossParams())[0].sum(), x.policy_chosen_logps)
    assert torch.allclose(g_w, g_p * w, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["aot", "aot_unpaired", "sft"])
def test_use_weighting_refused_where_trl_has_no_meaning_for_it(name):
    with pytest.raises(LossConfigError, match=f"use_weighting .*{name}"):
        combined_loss([name], None, _wpo_inputs(), LossParams(use_weighting=True))


def test_use_weighting_without_weights_is_a_caller_bug():
    from dataclasses import replace

    with pytest.raises(ValueError, match="wpo_weights"):
        combined_loss(["sigmoid"], None, replace(_wpo_inputs(), wpo_weights=None), LossParams(use_weighting=True))
