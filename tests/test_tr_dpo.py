"""TR-DPO (`sync_ref_model`, `ref_model_mixup_alpha`, `ref_model_sync_steps`) as TRL 1.16 implements it:
every `ref_model_sync_steps` optimizer steps, ref = alpha * policy + (1 - alpha) * ref.

Per-step parity with TRL 1.16's `DPOTrainer` reuses the harness of test_trl_parity.py (same records, tiny
model, sequential order, learning rate 1e-3) and its tolerances (`compare`, from `tolerances`).
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch

import test_trl_parity as parity
from conftest import tiny_model
from prefixdpo.dpo.tr_dpo import SyncReferenceCallback, tr_dpo_callback
from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer
from prefixdpo.errors import ConfigError
from prefixdpo.dpo.reference import AdapterReference, NoReference, PrecomputedReference, SeparateModelReference
from test_trl_parity import MOVED, compare, parity_setup, run_ours, run_trl, shared_options
from tolerances import K_FORWARD, assert_within

TR_DPO = dict(sync_ref_model=True, ref_model_mixup_alpha=0.5, ref_model_sync_steps=2)


def moved_policy(base, seed: int = 1):
    """A copy of `base` with every parameter moved by noise: a policy that differs from its reference."""
    policy = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return policy


def tr_args(**overrides):
    return SimpleNamespace(**{**TR_DPO, "precompute_ref_log_probs": False, "loss_type": ["sigmoid"], **overrides})


# ---------------------------------------------------------------------------------------------
# the update and when it happens
# ---------------------------------------------------------------------------------------------


def test_mix_in_is_trls_update_bit_for_bit():
    trl_callbacks = pytest.importorskip("trl.trainer.callbacks")
    base = tiny_model("llama")
    policy = moved_policy(base)
    policy_before = copy.deepcopy(policy.state_dict())
    reference = SeparateModelReference(copy.deepcopy(base))
    expected = copy.deepcopy(base)
    trl_callbacks.SyncRefModelCallback._sync_target_model(policy, expected, 0.3)

    reference.mix_in(policy, 0.3)
    mixed = dict(reference.model.named_parameters())
    for name, p in expected.named_parameters():
        assert torch.equal(mixed[name], p), name  # the same ops in the same order as TRL
        # and what TR-DPO defines: ref + alpha * (policy - ref), to fp32 rounding
        ref, pol = base.get_parameter(name), policy.get_parameter(name)
        want = ref + 0.3 * (pol - ref)
        assert_within(mixed[name], want, max(ref.abs().max().item(), pol.abs().max().item()), k=K_FORWARD, what=name)
    assert not torch.equal(mixed["model.embed_tokens.weight"], base.model.embed_tokens.weight)
    for name, b in base.named_buffers():  # buffers are not parameters: TRL leaves them alone
        assert torch.equal(reference.model.get_buffer(name), b), name
    for name, t in policy.state_dict().items():
        assert torch.equal(t, policy_before[name]), name  # the policy is only read
    assert not any(p.requires_grad for p in reference.model.parameters())


def test_callback_mixes_every_ref_model_sync_steps_optimizer_steps():
    base = tiny_model("llama")
    policy = moved_policy(base)
    reference = SeparateModelReference(copy.deepcopy(base))
    callback = SyncReferenceCallback(reference)
    args = tr_args(ref_model_mixup_alpha=0.5, ref_model_sync_steps=2)
    name = "model.layers.0.self_attn.q_proj.weight"
    ref0, pol = base.get_parameter(name).detach().clone(), policy.get_parameter(name).detach()
    # a fixed policy mixed in k times leaves ref0 * 0.5^k + policy * (1 - 0.5^k)
    expected_mixes = {1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3}
    for step, mixes in expected_mixes.items():
        callback.on_step_end(args, SimpleNamespace(global_step=step), None, model=policy)
        keep = 0.5**mixes
        assert_within(reference.model.get_parameter(name), ref0 * keep + pol * (1 - keep),
                      max(ref0.abs().max().item(), pol.abs().max().item()), k=K_FORWARD,
                      what=f"after optimizer step {step}")


# ---------------------------------------------------------------------------------------------
# what is refused, and what is ignored
# ---------------------------------------------------------------------------------------------


def test_off_unless_sync_ref_model(tmp_path):
    base = tiny_model("llama")
    reference = SeparateModelReference(copy.deepcopy(base))
    assert tr_dpo_callback(PrefixDPOConfig(output_dir=str(tmp_path), use_cpu=True), reference, base) is None
    assert tr_dpo_callback(tr_args(sync_ref_model=False), reference, base) is None
    assert isinstance(tr_dpo_callback(tr_args(), reference, base), SyncReferenceCallback)


def one_line_error(match: str, args, reference, policy) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        tr_dpo_callback(args, reference, policy)
    assert "\n" not in str(err.value)


def test_refused_with_peft_as_trl_does():
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    one_line_error(r"^sync_ref_model=True is not supported with a PEFT model", tr_args(), AdapterReference(), policy)


def test_refused_with_precomputed_reference(tmp_path):
    base = tiny_model("llama")
    reference = PrecomputedReference(SeparateModelReference(copy.deepcopy(base), chunk_size=64, backend="sdpa"),
                                     cache_dir=str(tmp_path), batch_size=2, pad_token_id=0, device="cpu")
    one_line_error(r"^sync_ref_model=True cannot be combined with precompute_ref_log_probs=True",
                   tr_args(precompute_ref_log_probs=True), reference, base)


def test_ignored_without_a_reference(caplog):
    with caplog.at_level(logging.WARNING, logger="prefixdpo.training.callbacks"):
        assert tr_dpo_callback(tr_args(loss_type=["simpo"]), NoReference(), tiny_model("llama")) is None
    assert "sync_ref_model=True has no effect: loss_type ['simpo'] uses no reference model" in caplog.text


def test_bad_values_and_mismatched_reference_refused():
    base = tiny_model("llama")
    reference = SeparateModelReference(copy.deepcopy(base))
    for steps in (0, -3, 1.5, True):
        one_line_error(rf"^ref_model_sync_steps={steps!r}: expected a positive integer",
                       tr_args(ref_model_sync_steps=steps), reference, base)
    for alpha in (-0.1, 1.5, float("nan")):
        one_line_error(rf"^ref_model_mixup_alpha={alpha!r}: expected a number in \[0, 1\]",
                       tr_args(ref_model_mixup_alpha=alpha), reference, base)
    other = SeparateModelReference(tiny_model("llama", intermediate_size=48))
    one_line_error(r"^sync_ref_model=True: ref_model's parameters differ from the policy's \(parameter 5: "
                   r"reference \('model.layers.0.mlp.gate_proj.weight', \(48, 32\)\), "
                   r"policy \('model.layers.0.mlp.gate_proj.weight', \(64, 32\)\)\)", tr_args(), other, base)
    tied = tiny_model("llama", tie_word_embeddings=True)  # its LM head is its embedding: one parameter fewer
    one_line_error(r"differ from the policy's \(parameter 20: reference \('lm_head.weight', \(96, 32\)\), "
                   r"policy nothing\)", tr_args(), reference, tied)


@pytest.mark.parametrize("options", [dict(ref_model_sync_steps=0), dict(ref_model_mixup_alpha=1.5),
                                     dict(precompute_ref_log_probs=True)])
def test_config_and_trainer_refuse_bad_options_with_the_same_line(tmp_path, options):
    """One check of the TR-DPO options (`check_tr_dpo_options`), run when the config is built and again by
    the trainer (its args can be changed in between)."""
    with pytest.raises(ConfigError) as at_config:
        PrefixDPOConfig(output_dir=str(tmp_path), use_cpu=True, **{**TR_DPO, **options})
    base = tiny_model("llama")
    with pytest.raises(ConfigError) as at_trainer:
        tr_dpo_callback(tr_args(**options), SeparateModelReference(copy.deepcopy(base)), base)
    assert str(at_config.value) == str(at_trainer.value)


# ---------------------------------------------------------------------------------------------
# per-step equality with TRL 1.16's DPOTrainer, sync_ref_model on
# ---------------------------------------------------------------------------------------------

# pack_length 80 packs these 16 records two per line, in file order (rows of 30-40 tokens): two lines
# per micro-batch are TRL's 4 records per step
PACKED = dict(packing=True, pack_length=80, per_device_train_batch_size=2)


def patch_harness(monkeypatch, trl_extra: dict, our_extra: dict, trainers: list) -> None:
    """Make test_trl_parity's `run_trl` / `run_ours` pass `trl_extra` / `our_extra` on top of their own options
    (they fix sync_ref_model=False and packing=False), and collect our trainers."""
    import trl

    trl_config = trl.DPOConfig
    monkeypatch.setattr(trl, "DPOConfig", lambda **kw: trl_config(**{**kw, **trl_extra}))

    def our_config(**kw):
        return PrefixDPOConfig(**{**kw, **our_extra})

    class Trainer(PrefixDPOTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            trainers.append(self)

    monkeypatch.setattr(parity, "PrefixDPOConfig", our_config)
    monkeypatch.setattr(parity, "PrefixDPOTrainer", Trainer)


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_per_step_metrics_equal_trl_dpo_trainer_with_sync_ref_model(tmp_path, monkeypatch, packing):
    records, tokenizer, base = parity_setup()
    options = shared_options(tmp_path, "run", 4, 1)
    layout = PACKED if packing else {}
    trainers: list = []
    patch_harness(monkeypatch, TR_DPO, {**layout, **TR_DPO}, trainers)
    trl_logs, trl_batches = run_trl(records, tokenizer, base, {**options, "output_dir": str(tmp_path / "trl")})
    our_logs, our_batches = run_ours(records, tokenizer, base, {**options, "output_dir": str(tmp_path / "ours")})
    patch_harness(monkeypatch, {}, layout, trainers)  # the same run of ours with a frozen reference
    frozen_logs, _ = run_ours(records, tokenizer, base, {**options, "output_dir": str(tmp_path / "frozen")})

    ours, frozen = trainers
    assert sum(isinstance(c, SyncReferenceCallback) for c in ours.callback_handler.callbacks) == 1
    assert not any(isinstance(c, SyncReferenceCallback) for c in frozen.callback_handler.callbacks)
    if packing:  # two records per packed line, two lines per micro-batch
        assert [len(line) for mb in ours._train_micro.plan[0] for line in mb] == [2] * 8
    assert our_batches == trl_batches and len(trl_batches) == 4  # the same records, step for step
    assert len(trl_logs) == len(our_logs) == len(frozen_logs) == 4

    oks, table = compare(trl_logs, our_logs)
    assert all(oks), table

    # The sync matters: the reference moved at the end of step 2 (not before), so steps 1-2 equal the frozen
    # reference's run and steps 3-4 do not (the policy's log-probs stay; the rewards change).
    for step in (0, 1):
        assert our_logs[step]["rewards/margins"] == frozen_logs[step]["rewards/margins"], step
    for step in (2, 3):
        gap = abs(our_logs[step]["rewards/chosen"] - frozen_logs[step]["rewards/chosen"])
        assert gap > MOVED, (step, gap, table)
    moved = [not torch.equal(p, q) for p, q in zip(ours.ref_model.parameters(), base.parameters())]
    assert all(moved) and not any(p.requires_grad for p in ours.ref_model.parameters())
