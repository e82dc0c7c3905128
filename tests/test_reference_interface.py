"""The reference is one interface (`prefixdpo.dpo.reference.Reference`): the trainer and the step run a
strategy they have never heard of, a user's constant reference with no model at all, through its methods alone.

A constant reference gives every response token the log-prob `c`, so a response of n tokens has reference sum
c * n and LD-DPO's split of a pair is c * (m + alpha * (n - m)), m the pair's shorter length. Tolerances fp32:
1e-6 absolute on per-pair values computed from the same policy pass; logged rewards against beta x logged
log-probs 1e-5 relative to the log-prob scale (both are means of the same fp32 sums).
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_examples, tiny_model
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.logprobs import ResponseLogps
from prefixdpo.data.batch import build_batch
from prefixdpo.data.loader import MicroBatch
from prefixdpo.dpo.config import PrefixDPOConfig
from prefixdpo.dpo.loss_table import LossParams
from prefixdpo.dpo.losses import LossConfigError
from prefixdpo.dpo.reference import PrecomputedReference, Reference, SeparateModelReference
from prefixdpo.dpo.step import Objective, pair_logps, pair_losses
from prefixdpo.dpo.tr_dpo import tr_dpo_callback
from prefixdpo.dpo.trainer import PrefixDPOTrainer
from prefixdpo.errors import ConfigError
from prefixdpo.core.attention.pass_plan import plan_pass
from tolerances import K_FORWARD, assert_within


class ConstantReference(Reference):
    """A user's reference: log-prob `per_token` for every response token; counts its passes."""

    name = "constant"

    def __init__(self, per_token: float):
        self.per_token = per_token
        self.passes = 0

    def response_logps(self, policy, batch, mask) -> ResponseLogps:
        self.passes += 1
        per_token = torch.full((batch.target_ids.numel(),), self.per_token)
        counts = batch.response_lengths
        return ResponseLogps(sums=counts.float() * self.per_token, counts=counts, per_token=per_token)


def test_the_step_runs_a_user_defined_reference():
    """pair_losses / pair_logps with a constant reference: DPO's loss and LD-DPO's split of its sums."""
    model, examples, c, beta = tiny_model("llama"), make_examples(6, ks=(2, 3)), -0.7, 0.5
    batch = build_batch(examples, prefix_sharing=True)
    mask = plan_pass(batch, "sdpa")
    policy = compute_response_logps(model, batch, mask)
    b, w, n = batch.pair_better, batch.pair_worse, batch.response_lengths.float()
    step = pair_losses(model, batch, mask, reference=ConstantReference(c),
                       objective=Objective(params=LossParams(beta=beta)))
    want = -torch.nn.functional.logsigmoid(beta * ((policy.sums[b] - c * n[b]) - (policy.sums[w] - c * n[w])))
    sums = max(policy.sums.abs().max().item(), (c * n).abs().max().item())
    assert_within(step.losses.detach(), want.detach(), beta * 4 * sums, k=K_FORWARD, what="losses")  # beta x 4 sums
    assert step.losses.requires_grad  # the policy's pass keeps its grad

    alpha = 0.3
    ld = pair_logps(model, batch, mask, reference=ConstantReference(c), params=LossParams(ld_alpha=alpha))
    shared = torch.minimum(n[b], n[w])
    scale = abs(c) * n.max().item()  # the constant reference's largest sum
    assert_within(ld.ref_chosen_logps, c * (shared + alpha * (n[b] - shared)), scale, k=K_FORWARD, what="LD chosen")
    assert_within(ld.ref_rejected_logps, c * (shared + alpha * (n[w] - shared)), scale, k=K_FORWARD,
                  what="LD rejected")
    assert bool((n[b] != n[w]).any())  # some pair really has a verbose tail to weigh


def test_the_trainer_trains_and_evaluates_with_a_user_defined_reference(tmp_path, monkeypatch):
    """`build_reference` replaced by a user's constant-zero reference: rewards are beta x the policy's
    log-probs at every step, train and eval; the coupled loss's pre-pass keeps the reference's sums, so the
    reference runs once per micro-batch; TRL's `ref_model` is None."""
    import prefixdpo.dpo.trainer as trainer_module

    reference = ConstantReference(0.0)
    monkeypatch.setattr(trainer_module, "build_reference", lambda args, **kwargs: reference)
    beta = 0.5
    args = PrefixDPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        logging_steps=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, beta=beta, report_to="none", gradient_checkpointing=False,
        loss_type=["aot"],  # coupled across the step's pairs: a no-grad pre-pass per micro-batch
    )
    trainer = PrefixDPOTrainer(model=tiny_model("llama"), args=args, train_dataset=make_examples(12),
                               eval_dataset=make_examples(4, seed=3))
    trainer.train()
    assert trainer.reference is reference and trainer.ref_model is None
    assert reference.passes == 3 * 2  # 3 optimizer steps x 2 micro-batches, each with pairs, one pass each
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    metrics = trainer.evaluate()
    for values, prefix in [*((h, "") for h in logs), (metrics, "eval_")]:
        scale = max(abs(values[f"{prefix}logps/chosen"]), abs(values[f"{prefix}logps/rejected"]))
        for side in ("chosen", "rejected"):
            got, want = values[f"{prefix}rewards/{side}"], beta * values[f"{prefix}logps/{side}"]
            assert_within(got, want, beta * scale, k=K_FORWARD, what=f"{prefix}rewards/{side}")
    assert logs[-1]["loss"] != pytest.approx(logs[0]["loss"], rel=1e-3)  # it trained


def test_tr_dpo_refuses_a_reference_that_cannot_move_in_one_line():
    args = type("Args", (), dict(sync_ref_model=True, precompute_ref_log_probs=False, loss_type=["sigmoid"],
                                 ref_model_sync_steps=2, ref_model_mixup_alpha=0.5))()
    with pytest.raises(ConfigError, match=r"^sync_ref_model=True needs a separate reference model to update; the "
                                          r"constant reference has none$"):
        tr_dpo_callback(args, ConstantReference(0.0), tiny_model("llama"))


def test_precomputed_sums_refuse_ld_alpha_in_one_line(tmp_path):
    """LD-DPO needs per-token log-probs, which precomputed tables do not hold (as before: a LossConfigError)."""
    model, examples = tiny_model("llama"), make_examples(4)
    batch = build_batch(examples, prefix_sharing=True)
    mask = plan_pass(batch, "sdpa")
    pre = PrecomputedReference(SeparateModelReference(tiny_model("llama")), cache_dir=str(tmp_path), batch_size=2,
                               pad_token_id=0, device="cpu")
    ids = torch.arange(len(examples))
    item = MicroBatch(batch, ids, step_pairs=batch.num_pairs, ref_logps=pre.table_for(examples, model).gather(ids))
    with pytest.raises(LossConfigError, match=r"^ld_alpha needs the reference's per-token log-probs") as err:
        pair_logps(model, batch, mask, reference=pre, item=item, params=LossParams(ld_alpha=0.5))
    assert "\n" not in str(err.value)
    # without ld_alpha the table's rows are the reference: the sums of a live pass of the same model
    live = pair_logps(model, batch, mask, reference=SeparateModelReference(pre.source.model))
    carried = pair_logps(model, batch, mask, reference=pre, item=item)
    assert_within(carried.ref_chosen_logps, live.ref_chosen_logps, live.ref_chosen_logps.abs().max().item(),
                  k=K_FORWARD, what="table vs live reference sums")
