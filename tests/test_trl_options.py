"""TRL 1.16 DPOConfig options on prefix-shared rows: `use_weighting` (WPO), `ld_alpha` (LD-DPO) and
`router_aux_loss_coef` (the MoE load-balancing loss), each with TRL's meaning.

`use_weighting` and `ld_alpha`: per-step loss, gradient norm, log-probs and rewards equal TRL's
`DPOTrainer` on the same tiny model, records and sequential order (learning rate 1e-3, fp32 CPU), prefix
sharing on, packing off and on. Tolerances as `test_trl_parity.compare` (from `tolerances`: loss and rewards
within beta x the log-prob sums' scale, where a bound relative to a reward near 0 is meaningless).

`router_aux_loss_coef`: TRL averages the load-balancing statistics over the tokens of its padded rows,
where each pair's prompt appears twice. A prefix-shared row holds the prompt once, so the model's own
aux loss of our row is NOT TRL's (asserted below: it differs). Exact equality is still possible: a
prompt's router logits are the same in both of TRL's rows (causal attention) and a response's equal
those of its separate sequence (the mask rule), so counting each token as often as TRL's rows hold it
(`moe.trl_token_multiplicity`) gives TRL's statistics. Asserted: our aux loss equals TRL's own
fused-head aux loss on its padded rows (fp32, relative 1e-5), packed and unpacked, for Mixtral and
Qwen3-MoE; the router logits we record are those the model itself returns for the same row.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_examples, tiny_model
from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer
from prefixdpo.data.batch import build_batch
from prefixdpo.data.loader import pack_in_order
from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
from test_trl_parity import MOVED, compare, parity_records, shared_options, step_logs
from tolerances import K_FORWARD, assert_within

# ---------------------------------------------------------------------------------------------
# use_weighting / ld_alpha: per-step equality with TRL 1.16's DPOTrainer
# ---------------------------------------------------------------------------------------------


def trl_step_logs(records, tokenizer, base, options) -> list[dict]:
    """TRL's per-step logs; `options` may hold the TRL options under test (the parity harness pins them)."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(**{"padding_free": False, "pad_to_multiple_of": None, "f_divergence_type": "reverse_kl",
                        "sync_ref_model": False, **options})
    trainer = DPOTrainer(model=copy.deepcopy(base), ref_model=copy.deepcopy(base), args=args,
                         train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer)
    trainer.train()
    return step_logs(trainer)


# Packed, a micro-batch is `per_device_train_batch_size` LINES. Lines of 150 tokens hold exactly four of
# `parity_records(16)` each, in file order (their rows are 30-40 tokens; asserted below), so one line per
# micro-batch holds the same four pairs as TRL's micro-batch of four.
PACKED = dict(per_device_train_batch_size=1, pack_length=150)


def our_step_logs(records, tokenizer, base, options, *, packing: bool) -> list[dict]:
    options = {**options, **(PACKED if packing else {})}
    args = PrefixDPOConfig(prefix_sharing=True, packing=packing, attention="sdpa", **options)
    trainer = PrefixDPOTrainer(model=copy.deepcopy(base), ref_model=copy.deepcopy(base), args=args,
                               train_dataset=records, processing_class=tokenizer)
    assert trainer.data_reports["train"].truncated == 0
    if packing:
        lengths = [ex.shared_length for ex in trainer.train_dataset]
        assert [len(line) for line in pack_in_order(lengths, PACKED["pack_length"])] == [4, 4, 4, 4], lengths
    trainer.train()
    return step_logs(trainer)


@pytest.fixture(scope="module")
def setup():
    pytest.importorskip("trl")
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    tokenizer = build_tiny_tokenizer()
    records = parity_records(16)
    return records, tokenizer, tiny_model("llama", vocab_size=len(tokenizer)), {}


@pytest.fixture(scope="module")
def trl_runs(setup, tmp_path_factory):
    """TRL's logs per option, run once for both packing settings."""
    records, tokenizer, base, cache = setup
    return lambda name, option: cache.setdefault(name, trl_step_logs(
        records, tokenizer, base, {**shared_options(tmp_path_factory.mktemp("trl"), "trl", 4, 1), **option}))


OPTIONS = {"wpo": {"use_weighting": True}, "ld": {"ld_alpha": 0.5}}


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_per_step_equal_trl_dpo_trainer(setup, trl_runs, tmp_path, name, packing):
    records, tokenizer, base, _ = setup
    option = OPTIONS[name]
    trl_logs = trl_runs(name, option)
    plain = trl_runs("plain", {})
    ours = our_step_logs(records, tokenizer, base, {**shared_options(tmp_path, "ours", 4, 1), **option},
                         packing=packing)
    assert len(trl_logs) == len(ours) == 4
    oks, table = compare(trl_logs, ours)
    assert all(oks), table
    # the option changed TRL's run (so equality is not plain DPO's): the first step's loss (WPO scales it)
    # or log-probs (LD-DPO re-weights them) differ from the plain run's
    key = "loss" if name == "wpo" else "logps/chosen"
    assert abs(trl_logs[0][key] - plain[0][key]) > 1e-2 * abs(plain[0][key]), (key, trl_logs[0], plain[0])
    # training moved the policy: rewards are not trivially zero after the first step
    assert all(abs(o["rewards/margins"]) > MOVED for o in ours[1:]), table


# ---------------------------------------------------------------------------------------------
# router_aux_loss_coef: the MoE load-balancing loss
# ---------------------------------------------------------------------------------------------

MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, num_key_value_heads=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True,
                      num_key_value_heads=2, head_dim=8, decoder_sparse_step=1, mlp_only_layers=[]),
}


def trl_rows(examples, pad: int):
    """TRL's padded rows: `[prompt][better]` for every pair, then `[prompt][worse]`; right padding."""
    seqs = [list(ex.prompt_ids) + list(ex.response_ids[i]) for ex in examples for i, _ in ex.pairs]
    seqs += [list(ex.prompt_ids) + list(ex.response_ids[j]) for ex in examples for _, j in ex.pairs]
    L = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (L - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
    return ids, mask


@pytest.mark.parametrize("arch", sorted(MOE))
def test_router_aux_loss_equals_trl_on_its_padded_rows(arch):
    pytest.importorskip("trl")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from trl.trainer.utils import add_fused_lm_head

    from prefixdpo.core.attention.pass_plan import plan_pass
    from prefixdpo.core.forward import compute_response_logps
    from prefixdpo.core.model_checks import prepare_model
    from prefixdpo.core.moe import recording_router_logits

    model = tiny_model(arch, **MOE[arch])
    examples = make_examples(6, seed=1, ks=(2, 3))  # K = 3 examples hold two pairs sharing the better response

    # TRL: its fused-head forward (the one DPOTrainer patches in) on standard padded rows
    trl_model = copy.deepcopy(model)
    add_fused_lm_head(trl_model, outputs=("log_probs",))
    ids, mask = trl_rows(examples, pad=0)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        trl_aux = trl_model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True,
                            output_router_logits=True).aux_loss

    prepare_model(model, "sdpa")
    for packs in (None, [[0, 1, 2], [3, 4, 5]]):
        batch = build_batch(examples, packs=packs)
        attention = plan_pass(batch, "sdpa")
        with torch.no_grad():
            ours = compute_response_logps(model, batch, attention, router_aux=True).aux_loss
        # E x sum over experts of (routed fraction x mean probability), inputs O(1 / E): its size is their scale
        assert_within(ours, trl_aux, trl_aux.abs().item(), k=K_FORWARD, what=f"aux loss, packs {packs}")

    # the router logits we record are the model's own for the same row, and counting the row's tokens
    # once (the model's own aux loss on it) is not TRL's value: the multiplicity is what makes them equal
    batch = build_batch(examples)
    attention = plan_pass(batch, "sdpa").mask
    with torch.no_grad(), recording_router_logits(model) as recorded:
        out = model.get_decoder()(input_ids=batch.input_ids, attention_mask=attention,
                                  position_ids=batch.position_ids, output_router_logits=True, use_cache=False)
    own = out.router_logits
    assert len(own) == len(recorded) == 2 and all(torch.equal(a, b) for a, b in zip(own, recorded))
    once = load_balancing_loss_func(own, 4, 2, (batch.spans[..., 0] >= 0).float())
    # ten times the tolerance the weighted value meets (measured: ~8e-4 relative for Qwen3-MoE)
    assert (once - trl_aux).abs() > 1e-4 * trl_aux.abs(), (once.item(), trl_aux.item())


def test_router_aux_loss_has_gradient_and_coef_resolves_as_trl():
    from prefixdpo.core.attention.pass_plan import plan_pass
    from prefixdpo.core.forward import compute_response_logps
    from prefixdpo.core.model_checks import prepare_model
    from prefixdpo.core.moe import resolve_router_aux_loss_coef
    from prefixdpo.core.forward import UnsupportedModelError

    model = tiny_model("mixtral", **MOE["mixtral"], router_aux_loss_coef=0.02)
    assert resolve_router_aux_loss_coef(model, None) == 0.02  # the model's own, as TRL
    assert resolve_router_aux_loss_coef(model, 0.5) == 0.5
    assert resolve_router_aux_loss_coef(tiny_model("llama"), None) == 0.0
    with pytest.raises(UnsupportedModelError, match="router_aux_loss_coef is set to 0.1 but LlamaForCausalLM"):
        resolve_router_aux_loss_coef(tiny_model("llama"), 0.1)
    prepare_model(model, "sdpa")
    batch = build_batch(make_examples(3))
    aux = compute_response_logps(model, batch, plan_pass(batch, "sdpa"), router_aux=True).aux_loss
    gate = model.model.layers[0].mlp.gate.weight
    (grad,) = torch.autograd.grad(aux, gate)
    assert grad.abs().max() > 0


def test_router_aux_loss_training_equals_trl_dpo_trainer(tmp_path):
    """router_aux_loss_coef end to end: per-step loss (with TRL's weighted aux term), grad norm, log-probs and
    rewards equal TRL 1.16's DPOTrainer on a tiny Mixtral, same tolerances as the other options."""
    pytest.importorskip("trl")
    tokenizer = build_tiny_tokenizer()
    records = parity_records(16)
    base = tiny_model("mixtral", vocab_size=len(tokenizer), **MOE["mixtral"])
    option = {"router_aux_loss_coef": 0.5}  # large, so a missing or mis-scaled aux term shows in the loss
    trl_logs = trl_step_logs(records, tokenizer, base, {**shared_options(tmp_path / "trl", "trl", 4, 1), **option})
    for packing in (False, True):
        ours = our_step_logs(records, tokenizer, base, {**shared_options(tmp_path / str(packing), "ours", 4, 1),
                                                        **option}, packing=packing)
        assert len(trl_logs) == len(ours) == 4
        oks, table = compare(trl_logs, ours)
        assert all(oks), f"packing={packing}\n{table}"
    plain = our_step_logs(records, tokenizer, base, {**shared_options(tmp_path / "p", "plain", 4, 1),
                                                     "router_aux_loss_coef": 0.0}, packing=False)
    assert abs(ours[0]["loss"] - plain[0]["loss"]) > 1e-3  # the aux term is in the loss
