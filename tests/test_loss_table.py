"""The loss table (prefixdpo.dpo.loss_table): a new loss is one function plus one row, and every other fact about
losses is read from the rows.

- A loss registered with `register_loss` trains with `PrefixDPOTrainer`: re-implementations of DPO and of the
  chosen NLL (coupled: it needs the step's token mean, across micro-batches) give the per-step losses and the
  final weights of the built-in `sigmoid` + `sft` (RPO) run, to 1e-6 relative / 1e-6 absolute (fp32).
- A registered running-mean loss (BCO re-implemented) gets its running state from its row alone and equals
  `bco_pair` over several steps (float64, 1e-12).
- Every built-in row computes from what it declares: inputs stripped to the declared fields give the same losses,
  and an option a row does not declare cannot be read.
- The config's facts follow the rows: names, `needs_reference`, options without effect.
Run time: about 15 s on two CPU threads (the two training runs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_examples
from prefixdpo.dpo.config import PrefixDPOConfig
from prefixdpo.dpo.coupling import StepCoupling
from prefixdpo.dpo.loss_table import (
    LOSS_TABLE,
    LossParams,
    LossRow,
    PairLogps,
    coupled,
    known_loss_names,
    logratios,
    losses_reading,
    needs_reference,
    needs_step_pairs,
    register_loss,
)
from prefixdpo.dpo.coupling import RunningMean, build_step_context
from prefixdpo.dpo.step import combined_loss
from prefixdpo.errors import ConfigError
from test_trainer import config, train, weights
from tolerances import K, K_FORWARD, assert_same_dpo_log, assert_same_weights, assert_within


@pytest.fixture
def table():
    """The loss table, restored after the test (registrations are global)."""
    saved = dict(LOSS_TABLE)
    yield LOSS_TABLE
    LOSS_TABLE.clear()
    LOSS_TABLE.update(saved)


# ---- two new losses, each one function + one row ----------------------------------------------------------


def plain_dpo(chosen_logratios, rejected_logratios, beta):
    """DPO written out: -log sigmoid(beta * (r_c - r_r)). ``[P] -> [P]``."""
    return -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))


def plain_nll(chosen_logps, mean_chosen_tokens):
    """The chosen responses' NLL, per token over the whole step. ``[P] -> [P]``."""
    return -chosen_logps / mean_chosen_tokens


def register_plain_losses():
    register_loss("plain_dpo", LossRow(lambda x, o, s: plain_dpo(*logratios(x), o.beta)))
    register_loss("plain_nll", LossRow(lambda x, o, s: plain_nll(x.policy_chosen_logps, s.mean_chosen_tokens),
                                       options=(), reference=False, lengths=("chosen_lengths",), token_mean=True))


def test_a_registered_loss_trains_as_the_loss_it_reimplements(tmp_path, table):
    register_plain_losses()
    assert {"plain_dpo", "plain_nll"} <= set(known_loss_names())
    examples = make_examples(12, ks=(2, 3))
    # two micro-batches per step: the NLL's token mean is the whole step's, from the derived step context
    opts = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=3, loss_weights=[1.0, 0.5])
    ours, logs = train(config(tmp_path / "new", loss_type=["plain_dpo", "plain_nll"], **opts), examples)
    builtin, logs_builtin = train(config(tmp_path / "builtin", loss_type=["sigmoid", "sft"], **opts), examples)
    assert ours.coupling.enabled and not ours.coupling.needs_pairs
    assert len(logs) == len(logs_builtin) == 3
    for a, b in zip(logs_builtin, logs):  # sigmoid (slope beta = 0.5) + 0.5 x sft (slope 0.5 / tokens): slope <= 1
        assert_same_dpo_log(a, b, 0.5, ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"), slope=1.0,
                            what=f"step {a['step']}")
    assert logs[-1]["loss"] != pytest.approx(logs[0]["loss"], rel=1e-3)  # it trained
    w_ours, w_builtin = weights(ours), weights(builtin)
    assert_same_weights(w_ours, w_builtin, k=K, what="final weights")  # the same steps, each through a backward


def test_a_registered_running_mean_loss_gets_its_state_from_its_row(table):
    register_loss("plain_bco", LossRow(
        lambda x, o, s: -F.logsigmoid(o.beta * logratios(x)[0] - s.running_mean)
                        - F.logsigmoid(-(o.beta * logratios(x)[1] - s.running_mean)),
        running_mean=lambda pairs, o: o.beta * torch.cat(logratios(pairs))))  # fmt: skip
    assert needs_step_pairs(["plain_bco"], train=True) and not needs_step_pairs(["plain_bco"], train=False)
    coupling = StepCoupling(type("Objective", (), {"loss_types": ("plain_bco",)}), accelerator=None)
    assert coupling.enabled and coupling.needs_pairs and list(coupling.running) == ["plain_bco"]

    p = LossParams(beta=0.3)
    states = {"plain_bco": RunningMean(), "bco_pair": RunningMean()}
    g = torch.Generator().manual_seed(3)
    for _ in range(3):  # three training steps: the mean moves, and the two losses move together
        x = PairLogps(*(-20 * torch.rand(5, generator=g, dtype=torch.float64) for _ in range(4)))
        got = {}
        for name in states:
            context = build_step_context([name], p, x.for_step(), num_pairs=5, chosen_tokens=None,
                                         running={name: states[name]}, train=True)
            got[name] = combined_loss([name], None, x, p, context)[0]
        # float64, the same formula: within its eps x beta x the four sums' size (|x| <= 20)
        assert_within(got["plain_bco"], got["bco_pair"], p.beta * 4 * 20, torch.float64, K_FORWARD, "plain_bco")
    assert states["plain_bco"] == states["bco_pair"] and states["bco_pair"].count == 30


# ---- the built-in rows say what their functions read ------------------------------------------------------


def _inputs(seed: int = 0) -> PairLogps:
    g = torch.Generator().manual_seed(seed)
    logps = [-(1 + 20 * torch.rand(6, generator=g, dtype=torch.float64)) for _ in range(4)]
    lengths = torch.randint(1, 12, (2, 6), generator=g)
    return PairLogps(*logps, chosen_lengths=lengths[0], rejected_lengths=lengths[1])


@pytest.mark.parametrize("name", sorted(LOSS_TABLE))
def test_each_row_computes_from_what_it_declares(name):
    row, full = LOSS_TABLE[name], _inputs()
    declared = PairLogps(
        full.policy_chosen_logps, full.policy_rejected_logps,
        full.ref_chosen_logps if row.reference else None, full.ref_rejected_logps if row.reference else None,
        *(getattr(full, f) if f in row.lengths else None for f in ("chosen_lengths", "rejected_lengths")),
    )  # fmt: skip
    p = LossParams(label_smoothing=0.1)
    want = combined_loss([name], None, full, p)[0]
    torch.testing.assert_close(combined_loss([name], None, declared, p)[0], want, rtol=0, atol=0)
    assert torch.isfinite(want).all() and want.abs().sum() > 0


def test_an_option_a_row_does_not_declare_cannot_be_read(table):
    register_loss("sneaky", LossRow(lambda x, o, s: plain_dpo(*logratios(x), o.simpo_gamma)))
    with pytest.raises(AttributeError, match="simpo_gamma"):
        combined_loss(["sneaky"], None, _inputs(), LossParams())


def test_bad_rows_and_taken_names_are_refused(table):
    compute = LOSS_TABLE["sigmoid"].compute
    with pytest.raises(ValueError, match="not LossParams fields"):
        LossRow(compute, options=("temperature",))
    with pytest.raises(ValueError, match="lengths"):
        LossRow(compute, lengths=("prompt_lengths",))
    with pytest.raises(ValueError, match="the step's pairs"):
        LossRow(compute, reference=False, step_values=lambda pairs: ())
    for name in ("sigmoid", "aot_pair"):
        with pytest.raises(ValueError, match="already in the loss table"):
            register_loss(name, LossRow(compute))
    with pytest.raises(ValueError, match="already in the loss table"):
        register_loss("new_name", LossRow(compute, aliases=("ipo",)))


# ---- facts derived from the rows ----------------------------------------------------------------------------


def test_derived_facts_of_the_builtin_rows():
    assert not needs_reference(["sft", "simpo", "orpo"]) and needs_reference(["simpo", "sigmoid"])
    assert not coupled(["sigmoid", "ipo", "simpo"])
    assert all(coupled([n]) for n in ("sft", "orpo", "aot", "aot_pair", "bco_pair"))
    assert {n for n in LOSS_TABLE if needs_step_pairs([n], train=True)} == {"aot", "aot_unpaired", "bco_pair"}
    assert {n for n in LOSS_TABLE if needs_step_pairs([n], train=False)} == {"aot", "aot_unpaired"}
    assert losses_reading("simpo_gamma") == ["simpo"] and losses_reading("discopop_tau") == ["discopop"]
    assert {n for n, r in LOSS_TABLE.items() if r.f_divergence} == {
        "sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}  # TRL 1.16's set
    assert {n for n, r in LOSS_TABLE.items() if not r.weighting} == {"aot", "aot_unpaired", "sft"}


def test_the_config_reads_the_table(tmp_path, table):
    register_loss("plain_simpo", LossRow(lambda x, o, s: plain_dpo(x.policy_chosen_logps, x.policy_rejected_logps,
                                                                   o.beta) + o.simpo_gamma,
                                         options=("beta", "simpo_gamma"), reference=False))
    args = PrefixDPOConfig(output_dir=str(tmp_path), loss_type=["plain_simpo"], simpo_gamma=1.0)
    assert not args.needs_reference  # no reference model is loaded for it
    with pytest.raises(ConfigError, match="^simpo_gamma=1.0 has no effect: it is a parameter of loss_type "
                                          "plain_simpo simpo, not of sigmoid$"):
        PrefixDPOConfig(output_dir=str(tmp_path), simpo_gamma=1.0)
    # the options the losses refuse are refused when the config is built, before any work
    with pytest.raises(ConfigError, match="use_weighting .*'aot'"):
        PrefixDPOConfig(output_dir=str(tmp_path), loss_type=["aot"], use_weighting=True)
    with pytest.raises(ConfigError, match="use_weighting .*'sft'"):
        PrefixDPOConfig(output_dir=str(tmp_path), rpo_alpha=0.5, use_weighting=True)  # RPO adds sft
    with pytest.raises(ConfigError, match="f_divergence_type='forward_kl' is only defined for"):
        PrefixDPOConfig(output_dir=str(tmp_path), loss_type=["nca_pair"], f_divergence_type="forward_kl")
    with pytest.raises(ConfigError, match="loss type listed twice"):
        PrefixDPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "sigmoid"])


def test_a_checkpoint_from_before_the_table_restores_bco_running_mean():
    coupling = StepCoupling(type("Objective", (), {"loss_types": ("sigmoid", "bco_pair")}), accelerator=None)
    coupling.load_state_dict({"bco_running_mean": {"mean": 0.25, "count": 12}})
    assert coupling.running["bco_pair"] == RunningMean(0.25, 12)
    assert coupling.state_dict() == {"running_means": {"bco_pair": {"mean": 0.25, "count": 12}}}
