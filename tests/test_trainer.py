"""PrefixDPOTrainer end to end on a tiny fp32 Llama built from a config.

Equivalence: prefix-shared training (unpacked, packed, K-response rows) against standard paired
training (`prefix_sharing=False, packing=False`: every response its own `[prompt][response]` row) on the
same example groups per step, several SGD steps of DPO with a reference model. Tolerances (`tolerances`, fp32,
and one float64 run): per-step loss and rewards within beta x the step's log-prob sums' scale (a loss near log 2
and a reward, beta x a small difference of two ~-30 sums, carry the sums' rounding, not their own size's); log-prob
metrics within the sums' scale; final weights within the largest weight plus the largest total move.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal

import pytest
import torch

from prefixdpo.core.attention.pass_plan import plan_pass
from conftest import make_examples, tiny_model
from prefixdpo.commands.train import parse_train_args
from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer
from prefixdpo.data.loader import LoaderSettings, MicroBatches, plan_epoch, step_pair_totals
from prefixdpo.errors import UserError
from prefixdpo.dpo.trainer import NonFiniteLossError
from tolerances import (K, K_FORWARD, assert_logged_loss_within, assert_within, bound, dpo_loss_scale, in_dtype,
                        weights_scale)

REWARDS, LOGPS = ("rewards/chosen", "rewards/rejected", "rewards/margins"), ("logps/chosen", "logps/rejected")


def config(tmp_path, **kw) -> PrefixDPOConfig:
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=4, logging_steps=1,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0, beta=0.5, ref_cache_dir=str(tmp_path / "cache"), report_to="none",
        gradient_checkpointing=False,  # TRL's default is on; these runs are tiny and checkpointing is tested apart
    )
    base.update(kw)
    return PrefixDPOConfig(**base)


def train(args, examples, trainer_cls=PrefixDPOTrainer, model=None, **kw):
    trainer = trainer_cls(model=model if model is not None else tiny_model("llama"), args=args,
                          train_dataset=examples, **kw)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def assert_same_run(logs_a, logs_b, w_a=None, w_b=None, weight_k: float = K, beta: float = 0.5,
                    dtype: torch.dtype = torch.float32):
    """Two runs of the same steps in `dtype` agree (`tolerances`): each step's loss and rewards within beta x its
    log-prob sums' scale (`dpo_loss_scale`, `assert_logged_loss_within`), its logps/* within those sums' largest;
    the final weights [named] within the scale their steps' rounding builds up in (`weights_scale` from the tiny
    Llama every run starts from). Losses, rewards and log-probs are forward values (K_FORWARD, the steps small next
    to the weights), the weights sums over every token's gradient (K). weight_k=0: bitwise equal weights."""
    assert len(logs_a) == len(logs_b) > 0
    for a, b in zip(logs_a, logs_b):
        step, scale = b["step"], dpo_loss_scale(b, beta)
        assert_logged_loss_within(a["loss"], b["loss"], scale, dtype, what=f"step {step} loss")
        assert_within([a[k] for k in REWARDS], [b[k] for k in REWARDS], scale, dtype, K_FORWARD, f"step {step} rewards")
        sums = max(abs(b["logps/chosen"]), abs(b["logps/rejected"]))
        assert_within([a[k] for k in LOGPS], [b[k] for k in LOGPS], sums, dtype, K_FORWARD, f"step {step} logps")
        # Accuracy is a step function of each pair's margin: compare it only where no margin can be a tie.
        # While the policy still equals its reference (step 1) every margin is 0 up to rounding, and the
        # last bits differ between CPUs, so there the rewards themselves must be ~0 instead.
        if max(abs(b["rewards/chosen"]), abs(b["rewards/rejected"])) <= bound(scale, k=K_FORWARD):
            assert max(abs(a["rewards/chosen"]), abs(a["rewards/rejected"])) <= bound(scale, k=K_FORWARD)
        else:
            assert a["rewards/accuracies"] == b["rewards/accuracies"]
    if w_a is not None:
        start = dict(tiny_model("llama").named_parameters())
        flat_a, flat_b, flat_start = (torch.cat([w[k].detach().flatten() for k in w_b]) for w in (w_a, w_b, start))
        assert_within(flat_a, flat_b, weights_scale(flat_start, flat_b), dtype, k=weight_k, what="final weights")


class StandardOnPlan(PrefixDPOTrainer):
    """Standard paired rows, on the example groups a prefix-shared packed plan would use."""

    plan_kwargs: dict = {}

    def _micro_batches(self, examples, *, train, name="train"):
        settings = self._loader_settings(train=train)
        plan = dataclasses.replace(settings, prefix_sharing=True, **self.plan_kwargs)
        return MicroBatches(examples, settings, rank=self.args.process_index, world_size=self.args.world_size,
                            plan_settings=plan)


CASES = {
    "unpacked": (dict(), dict(ks=(2,))),
    "packed": (dict(packing=True, pack_length=64, per_device_train_batch_size=2), dict(ks=(2,))),
    "k_responses": (dict(), dict(ks=(3, 4, 2))),
    "k_responses_packed": (dict(packing=True, pack_length=96, per_device_train_batch_size=2), dict(ks=(3, 4))),
}


@pytest.mark.parametrize("case,dtype", [(case, torch.float32) for case in CASES] + [("packed", torch.float64)])
def test_prefix_sharing_equals_standard_training(tmp_path, case, dtype):
    """float64 (`tolerances.in_dtype`): the same runs agree to float64 rounding, so fp32's difference is rounding."""
    opts, data = CASES[case]
    examples = make_examples(16, ks=data["ks"])
    shared, logs_shared = train(config(tmp_path, **opts), examples, model=in_dtype(tiny_model("llama"), dtype))
    packed = {k: v for k, v in opts.items() if k in ("packing", "pack_length")}
    StandardOnPlan.plan_kwargs = packed
    std_opts = {**opts, "packing": False, "prefix_sharing": False}
    std_opts.pop("pack_length", None)
    standard, logs_std = train(config(tmp_path, **std_opts), examples, trainer_cls=StandardOnPlan,
                               model=in_dtype(tiny_model("llama"), dtype))
    assert_same_run(logs_shared, logs_std, weights(shared), weights(standard), dtype=dtype)
    # the run did something, and prefix sharing saved tokens while the standard run saved none
    assert logs_shared[-1]["loss"] != pytest.approx(logs_shared[0]["loss"], rel=1e-3)
    assert logs_shared[0]["prefix_sharing/tokens_saved"] > 0.2
    assert logs_std[0]["prefix_sharing/tokens_saved"] == 0.0
    if "packing" in opts:
        assert logs_shared[0]["packing/efficiency"] > 0.5


def test_grad_accumulation_normalises_by_pairs(tmp_path):
    """Packed lines hold different pair counts: 2 micro-batches x 1 line == 1 micro-batch x 2 lines."""
    examples = make_examples(16, ks=(2, 3))
    opts = dict(packing=True, pack_length=64)
    t1, one = train(config(tmp_path, per_device_train_batch_size=2, **opts), examples)
    t2, acc = train(config(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2, **opts), examples)
    assert_same_run(acc, one, weights(t2), weights(t1))
    # the micro-batches really had unequal pair counts
    mb = t2._train_micro
    counts = {len([p for e in line for p in examples[e].pairs]) for m in mb.plan[0] for line in m}
    assert len(counts) > 1


def test_reference_modes(tmp_path, monkeypatch):
    examples = make_examples(12)
    # default reference = frozen copy of the start; an explicit copy gives the same run
    t_copy, logs_copy = train(config(tmp_path), examples)
    assert t_copy.reference.name == "model"
    t_ref, logs_ref = train(config(tmp_path), examples, ref_model=tiny_model("llama"))
    assert_same_run(logs_ref, logs_copy, weights(t_ref), weights(t_copy), weight_k=1)

    # precomputed: same numbers, no reference model kept, and a second run reuses the cache
    import prefixdpo.dpo.reference_cache as reference_cache

    calls = []
    real = reference_cache.compute_table
    monkeypatch.setattr(reference_cache, "compute_table", lambda *a, **k: calls.append(1) or real(*a, **k))
    t_pre, logs_pre = train(config(tmp_path, precompute_ref_log_probs=True), examples)
    assert t_pre.reference.name == "precomputed" and t_pre.ref_model is None
    assert calls == [1] and t_pre.reference.cache_hits == {"train": False}
    assert_same_run(logs_pre, logs_copy, weights(t_pre), weights(t_copy))
    t_again, logs_again = train(config(tmp_path, precompute_ref_log_probs=True), examples)
    assert calls == [1] and t_again.reference.cache_hits == {"train": True}  # no reference forward at all
    assert_same_run(logs_again, logs_pre, weights(t_again), weights(t_pre), weight_k=0)
    # other data -> another key -> computed again
    train(config(tmp_path, precompute_ref_log_probs=True, max_steps=1), examples[:8])
    assert calls == [1, 1]

    # reference-free loss: no reference loaded or run
    t_free, logs_free = train(config(tmp_path, loss_type=["simpo"]), examples)
    assert t_free.reference.name == "none" and t_free.ref_model is None
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs_free)


def test_lora_adapter_reference_and_precompute(tmp_path):
    from peft import LoraConfig

    examples = make_examples(12)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    t_lora, logs_lora = train(config(tmp_path, learning_rate=1.0), examples, peft_config=lora)
    assert t_lora.reference.name == "adapter" and t_lora.ref_model is None
    # adapter starts as identity: first-step rewards are exactly zero (reference = adapter off)
    assert logs_lora[0]["rewards/chosen"] == 0.0 and logs_lora[0]["loss"] == pytest.approx(0.6931472, rel=1e-6)
    base_before = tiny_model("llama").state_dict()
    for name, p in t_lora.model.named_parameters():
        if "lora_" in name:
            assert p.requires_grad
        else:
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(p.detach(), base_before[key]), name  # base weights untouched
    assert logs_lora[-1]["rewards/margins"] != 0.0

    t_pre, logs_pre = train(config(tmp_path, learning_rate=1.0, precompute_ref_log_probs=True), examples,
                            peft_config=lora)
    assert t_pre.reference.name == "precomputed"
    assert_same_run(logs_pre, logs_lora)

    t_lora.save_model(str(tmp_path / "adapter"))
    assert os.path.isfile(tmp_path / "adapter" / "adapter_model.safetensors")


@pytest.mark.parametrize("loss", ["sigmoid", "bco_pair"])
def test_resume_equals_uninterrupted(tmp_path, loss):
    """bco_pair carries a running reward mean across steps: it is saved in checkpoints and restored."""
    examples = make_examples(16)
    opts = dict(max_steps=6, optim="adamw_torch", learning_rate=1e-2, per_device_train_batch_size=3, loss_type=[loss])
    full, logs_full = train(config(tmp_path, **opts), examples)  # 16 / 3 -> 6 micro-batches: 1 epoch
    first, _ = train(config(tmp_path, output_dir=str(tmp_path / "r"), save_strategy="steps", save_steps=3,
                            max_steps=3, **{k: v for k, v in opts.items() if k != "max_steps"}), examples)
    resumed = PrefixDPOTrainer(model=tiny_model("llama"), args=config(tmp_path, output_dir=str(tmp_path / "r"), **opts),
                               train_dataset=examples)
    resumed.train(resume_from_checkpoint="latest")
    logs_resumed = [h for h in resumed.state.log_history if "loss" in h]
    assert [h["step"] for h in logs_resumed[-3:]] == [4, 5, 6]
    assert_same_run(logs_resumed[-3:], logs_full[-3:], weights(resumed), weights(full), weight_k=K_FORWARD)
    state, expected = resumed.coupling.state_dict()["running_means"], full.coupling.state_dict()["running_means"]
    assert state.keys() == expected.keys() == ({"bco_pair"} if loss == "bco_pair" else set())
    for name in expected:  # a running mean of rewards: within the rewards' scale (beta x the sums')
        assert_within(state[name]["mean"], expected[name]["mean"], dpo_loss_scale(logs_full[-1], 0.5), k=K_FORWARD,
                      what=f"{name} running mean")
        assert state[name]["count"] == expected[name]["count"] > 0


def test_multi_epoch_replans_with_seed(tmp_path):
    examples = make_examples(8)
    t, logs = train(config(tmp_path, max_steps=-1, num_train_epochs=2, per_device_train_batch_size=4), examples)
    assert len(logs) == 4 and t.state.epoch == 2
    mb = MicroBatches(examples, LoaderSettings(batch_size=4, seed=0))
    first = [list(m) for m in mb.plan[0]]
    mb.set_epoch(1)
    assert [list(m) for m in mb.plan[0]] != first  # a new order each epoch
    mb.set_epoch(0)
    assert [list(m) for m in mb.plan[0]] == first  # and reproducible


def test_plan_is_rank_even_with_uneven_data():
    examples = make_examples(7, ks=(2, 3))
    for packing in (False, True):
        s = LoaderSettings(batch_size=2, packing=packing, pack_length=64, grad_accum=2)
        plan = plan_epoch(examples, s, epoch=0, world_size=2)
        assert len(plan[0]) == len(plan[1])
        seen = sorted(e for r in plan for m in r for line in m for e in line)
        assert seen == list(range(7))
        totals = step_pair_totals(examples, plan, 2)
        assert sum(totals) == sum(len(ex.pairs) for ex in examples)


def test_save_model_loads_with_stock_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    examples = make_examples(8)
    t, _ = train(config(tmp_path, max_steps=1), examples)
    t.save_model(str(tmp_path / "final"))
    cfg = json.loads((tmp_path / "final" / "config.json").read_text())
    assert "prefixdpo" not in json.dumps(cfg)
    assert any(f.endswith(".safetensors") for f in os.listdir(tmp_path / "final"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = copy.deepcopy(t.model)
        ref.set_attn_implementation("sdpa")
        want = ref(ids).logits  # the same weights through the same attention: equal to their own rounding
        assert_within(loaded(ids).logits, want, want.abs().max().item(), k=K_FORWARD, what="logits")


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    class Exploding(PrefixDPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss * float("nan") if self.state.global_step == 2 else loss

    examples = make_examples(16)
    args = config(tmp_path, save_strategy="steps", save_steps=1)
    trainer = Exploding(model=tiny_model("llama"), args=args, train_dataset=examples)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    # a UserError: the command line prints this one line (naming the last good checkpoint), no traceback
    with pytest.raises(UserError, match="optimizer step 3.*checkpoint-2") as info:
        trainer.train()
    # the preemption and Ctrl-C handlers are gone with the failed run
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert isinstance(info.value, NonFiniteLossError)
    assert sorted(os.listdir(args.output_dir)) == ["checkpoint-1", "checkpoint-2"]
    from safetensors.torch import load_file

    saved = load_file(os.path.join(args.output_dir, "checkpoint-2", "model.safetensors"))
    current = trainer.model.state_dict()
    assert all(torch.equal(saved[k], current[k]) for k in saved)  # the bad step was never applied


def test_bad_trainer_input_is_a_user_error(tmp_path):
    """What the user gives the trainer, when wrong, raises a UserError naming it (one line, exit 2 on the
    command line), not an exception that reads as a bug."""
    model, args = tiny_model("llama"), config(tmp_path, output_dir=str(tmp_path / "empty"))
    trainer = PrefixDPOTrainer(model=model, args=args, train_dataset=make_examples(4))
    with pytest.raises(UserError, match=r"resume_from_checkpoint='latest': no checkpoint-\* folder in .*empty"):
        trainer.train(resume_from_checkpoint="latest")
    with pytest.raises(UserError, match="evaluation needs an eval_dataset"):
        trainer.get_eval_dataloader()
    with pytest.raises(UserError, match="^train dataset is empty$"):
        PrefixDPOTrainer(model=model, args=args, train_dataset=[])
    records = [{"prompt": "Q:", "chosen": " a", "rejected": " b"}]
    with pytest.raises(UserError, match="train dataset holds records, not Examples: pass processing_class"):
        PrefixDPOTrainer(model=model, args=args, train_dataset=records)
    with pytest.raises(UserError, match="needs a model"):
        PrefixDPOTrainer(model=None, args=args, train_dataset=make_examples(4))


def test_parse_train_args_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("beta: 0.2\nloss_type: [sigmoid, sft]\nloss_weights: [1.0, 0.5]\npacking: true\nuse_peft: true\n"
                    "lora_r: 8\n")
    cfg, model_args, data_args = parse_train_args([str(path), "--beta", "0.05", "--pack-length", "256",
                                                   "--output-dir", str(tmp_path / "o")])
    assert cfg.beta == 0.05 and cfg.loss_type == ["sigmoid", "sft"] and cfg.loss_weights == [1.0, 0.5]
    assert cfg.packing and cfg.pack_length == 256 and model_args.lora_r == 8
    assert model_args.peft_config().r == 8
    with pytest.raises(ValueError, match="unknown option"):
        parse_train_args(["--no-such-option", "1"])
    with pytest.raises(ValueError, match="unknown loss_type"):
        PrefixDPOConfig(output_dir=str(tmp_path), loss_type=["nope"])



def test_gradient_checkpointing_and_segmented_attention_match_the_plain_run(tmp_path):
    """Activation checkpointing (recompute in backward) and the segmented attention backend give the same
    training run as the default dense-mask run without checkpointing."""
    examples = make_examples(12, ks=(2, 3))
    base, logs = train(config(tmp_path / "a", packing=True), examples)
    other, other_logs = train(
        config(tmp_path / "b", packing=True, activation_checkpointing=True, attention="segmented"), examples)
    assert other.model.is_gradient_checkpointing
    assert_same_run(other_logs, logs, weights(other), weights(base))


def test_precomputed_reference_evaluates_new_data_with_the_reference_not_the_policy(tmp_path):
    """After training, `evaluate(new_data)` with a precomputed reference computes the new table from the
    reference (parked on the CPU), never from the trained policy: same metrics as a live reference (1e-5)."""
    examples, other = make_examples(12), make_examples(8, seed=5)
    live, _ = train(config(tmp_path), examples)
    pre, _ = train(config(tmp_path, precompute_ref_log_probs=True), examples)
    a, b = live.evaluate(other), pre.evaluate(other)
    assert abs(a["eval_rewards/chosen"]) > 1e-2  # the policy moved away from its reference
    scale = dpo_loss_scale(a, 0.5, "eval_")
    for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected"):
        assert_within(b[key], a[key], scale, k=K_FORWARD, what=key)
    assert_within(b["eval_logps/chosen"], a["eval_logps/chosen"], abs(a["eval_logps/chosen"]), k=K_FORWARD,
                  what="eval_logps")
    assert pre.reference.cache_hits["eval"] is False  # a new table, computed after training


def test_reference_tables_are_keyed_by_content_and_every_weight(tmp_path):
    import prefixdpo.core.fingerprints as fingerprints
    import prefixdpo.dpo.reference_cache as reference
    from prefixdpo.dpo.reference import reference_response_logps

    examples = make_examples(6)
    model = tiny_model("llama")
    settings = {"dtype": "torch.float32"}
    cache = str(tmp_path / "cache")

    def sums_of(batch):
        return reference_response_logps(model, batch, plan_pass(batch, "sdpa")).sums

    first, _, hit = reference.load_or_compute_table(model, examples, cache, sums_of=sums_of, settings=settings)
    assert not hit
    assert reference.load_or_compute_table(model, list(examples), cache, sums_of=sums_of,
                                           settings=settings)[2]  # same content
    with torch.no_grad():  # one element of one weight
        p = dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
        p.view(-1)[p.numel() // 2 + 3] += 1e-3
    changed, _, hit = reference.load_or_compute_table(model, examples, cache, sums_of=sums_of, settings=settings)
    assert not hit and not torch.equal(changed.sums, first.sums)
    # every element counts, also in tensors large enough that a strided sample (the old key) skipped some
    big = torch.nn.Linear(2048, 1100, bias=False)
    before = fingerprints.weights_fingerprint(big)
    with torch.no_grad():
        big.weight.view(-1)[1] += 1e-3  # odd index: a stride-2 sample never reads it
    assert fingerprints.weights_fingerprint(big) != before
    # two eval sets of one trainer get two tables, whatever Python objects hold them
    t, _ = train(config(tmp_path, precompute_ref_log_probs=True, max_steps=1), examples)
    evals = [make_examples(4, seed=1), make_examples(4, seed=2)]
    t.evaluate(evals[0]), t.evaluate(evals[1])
    tables = t.reference.tables
    assert len(tables) == 3 and len({fingerprints.data_fingerprint(e) for e in evals}) == 2
    assert all(fingerprints.data_fingerprint(e) in tables for e in evals)


def test_throughput_counts_pairs(tmp_path):
    """Trainer's `train_samples_per_second` counts pairs (not micro-batches): a packed epoch of 16 pairs in a
    few micro-batches reports 16 pairs over the run time."""
    examples = make_examples(16)
    t, logs = train(config(tmp_path, packing=True, pack_length=64, per_device_train_batch_size=2, max_steps=-1,
                           num_train_epochs=1), examples)
    final = t.state.log_history[-1]
    assert len(t._train_micro) < 16  # several pairs per micro-batch
    assert final["train_samples_per_second"] == pytest.approx(16 / final["train_runtime"], rel=1e-2, abs=2e-3)
    assert all(h["pairs_per_second"] > 0 for h in logs)


def test_prepass_of_coupled_losses_runs_the_reference_once_per_micro_batch(tmp_path, monkeypatch):
    """aot under gradient accumulation pre-passes the step; the reference's sums from that pass are reused."""
    from prefixdpo.dpo.reference import SeparateModelReference

    calls = []
    real = SeparateModelReference.response_logps
    monkeypatch.setattr(SeparateModelReference, "response_logps",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    train(config(tmp_path, loss_type=["aot"], max_steps=1, per_device_train_batch_size=2,
                 gradient_accumulation_steps=2), make_examples(4))
    assert len(calls) == 2  # two micro-batches, one reference pass each (not two)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_reference_table_runs_the_same_number_of_batches_on_every_rank(monkeypatch, rank):
    """A sharded model's forward is a collective: a rank with fewer examples must still run every batch."""
    import prefixdpo.dpo.reference_cache as reference

    examples = make_examples(7)  # over 3 ranks: 3, 2, 2 examples; batch 2 -> 2 batches each
    calls = []

    def fake_sums(batch):
        calls.append(batch.num_responses)
        return torch.arange(batch.num_responses, dtype=torch.float32)

    monkeypatch.setattr(reference, "rank_and_world", lambda: (rank, 3))
    others = {i: [0.0] * ex.num_responses for i, ex in enumerate(examples)}  # what the other ranks send
    monkeypatch.setattr(reference, "gather", lambda obj: [others, others, obj])
    table = reference.compute_table(fake_sums, examples, batch_size=2, device="cpu")
    assert len(calls) == 2
    assert len(table) == len(examples)


MASK_CASES = {  # options of a 1-step run of 2 micro-batches (batch 2, accumulation 2)
    "sigmoid": dict(),  # policy pass + the separate reference's pass
    "aot": dict(loss_type=["aot"]),  # the step's pre-pass (reference + no-grad policy), then the training pass
    "aot_ld": dict(loss_type=["aot"], ld_alpha=0.5),  # the reference's tokens rerun in the training pass
    "precomputed": dict(precompute_ref_log_probs=True),  # the table's rows come with the micro-batch
}


def record_masks_and_micro_batches(monkeypatch) -> tuple[list, list]:
    """(every sdpa mask made, whoever asks for it; every MicroBatch the loader makes), as they happen."""
    import prefixdpo.core.attention.pass_plan as pass_plan

    masks, made = [], []
    real_mask, real_item = pass_plan.dense_mask, MicroBatches.__getitem__

    def counted_mask(spans, queries_from=0):
        masks.append(spans.shape[:2])
        return real_mask(spans, queries_from)

    monkeypatch.setattr(pass_plan, "dense_mask", counted_mask)
    monkeypatch.setattr(MicroBatches, "__getitem__", lambda self, m: made.append(real_item(self, m)) or made[-1])
    return masks, made


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_a_training_step_builds_one_mask_per_micro_batch(tmp_path, monkeypatch, case):
    """Every pass over a micro-batch (policy, reference, the coupled losses' pre-pass) shares one mask, counted
    where the sdpa mask is made, whoever calls; evaluation too. And Trainer hands `compute_loss` the loader's own
    MicroBatch objects (beside the step's derived values), untouched."""
    from prefixdpo.data.loader import MicroBatch

    masks, made = record_masks_and_micro_batches(monkeypatch)
    seen = []

    class Recording(PrefixDPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append(inputs.micro)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = config(tmp_path, max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  per_device_eval_batch_size=2, **MASK_CASES[case])
    trainer = Recording(model=tiny_model("llama"), args=args, train_dataset=make_examples(4),
                        eval_dataset=make_examples(4, seed=1))
    masks.clear()  # a precomputed table's own batches are not the step's
    trainer.train()
    assert len(seen) == 2 and all(isinstance(m, MicroBatch) for m in seen)
    assert all(a is b for a, b in zip(seen, made[: len(seen)]))  # the loader's objects, in order
    assert len(masks) == 2
    masks.clear()
    trainer.evaluate()
    assert len(masks) == 2  # two evaluation micro-batches
