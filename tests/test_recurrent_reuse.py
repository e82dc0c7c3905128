"""Prefix reuse on hybrid models: a line's prefix runs once, its chunks run from the prefix's final recurrent states.

The prefix's pass records each recurrent layer's final convolution window and recurrent state
(`PrefixKV.states`, beside the attention's keys and values); every chunk's runs that descend straight from the prefix
start from them (`core.recurrent.mixers`), with gradients reaching the prefix through them. Against the one-row pass
of the same model (fp32): the response log-prob sums within K_FORWARD eps x the largest |sum| and the gradients of a
weighted sum within K eps x the largest entry (`tolerances`), for budgets that cut the first line (59 tokens) into 5,
4 and 1 chunks, on Qwen3.5 (Gated DeltaNet), LFM2 (short convolutions) and NemotronH (Mamba2). A one-token response
(one of the chunks at budget 1) runs from the prefix's state padded to two columns, as every call from a state.
"""

from __future__ import annotations

import pytest
import torch

from prefixdpo.core.attention.pass_plan import plan_pass, reuse_pass_plan
from prefixdpo.core.attention.reuse_plan import plan_reuse
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.data.batch import build_batch
from prefixdpo_tools.hybrid_models import tiny_hybrid_lm
from test_prefix_reuse import _examples, _sums_and_grads
from tolerances import K, K_FORWARD, assert_within


def _model(family: str):
    model = tiny_hybrid_lm(family)
    assert prepare_model(model, "sdpa") == "sdpa"
    return model


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2", "nemotron_h"])
def test_reused_prefix_gives_the_one_row_sums_and_gradients_on_hybrids(family):
    model = _model(family)
    batch = build_batch(_examples(), pad_multiple=8)
    sums, grads = _sums_and_grads(model, batch, plan_pass(batch, "sdpa"))
    assert grads.abs().max() > 1e-2
    for budget, chunks in {1: 5, 13: 4, 35: 1}.items():
        reuse = plan_reuse(batch.spans, budget, "sdpa")
        assert len(reuse.plans[0].chunks) == chunks
        r_sums, r_grads = _sums_and_grads(model, batch, reuse_pass_plan(batch.spans, reuse))
        assert_within(r_sums, sums, sums.abs().max().item(), k=K_FORWARD, what=f"{family} budget {budget} sums")
        assert_within(r_grads, grads, grads.abs().max().item(), k=K, what=f"{family} budget {budget} gradients")


def test_without_the_prefixs_states_a_chunk_is_far_off(monkeypatch):
    """The check sees what the states carry: chunks run from the zero state instead are nats off."""
    import prefixdpo.core.recurrent.mixers as mixers

    model = _model("lfm2")
    batch = build_batch(_examples(), pad_multiple=8)
    sums, _ = _sums_and_grads(model, batch, plan_pass(batch, "sdpa"))
    zero = mixers._root_states
    monkeypatch.setattr(mixers, "_root_states", lambda layer_idx, n, initial: zero(layer_idx, n, None))
    r_sums, _ = _sums_and_grads(model, batch, reuse_pass_plan(batch.spans, plan_reuse(batch.spans, 13, "sdpa")))
    assert (r_sums - sums).abs().max() > 0.1
