"""A rank-balancing empty micro-batch (`step.zero_weight_loss` on `loader.stand_in_batch`, asking a
`reference.IdleReference`) calls the same modules of the policy and of the reference, in the same order, as a micro-batch
with pairs (`step.pair_losses`), and its loss is 0 with a zero gradient for every policy parameter. Engines that
gather a module's weights at each call (FSDP2, ZeRO-3) or broadcast buffers at each call of their wrapper (DDP) need
exactly that on every rank. Cases: plain; the reference's sums already in hand (a coupled loss's pre-pass ran it);
LD-DPO (per-token reference); WPO weights; no reference; the policy with its LoRA adapter off as the reference.
About 3 s."""

from __future__ import annotations

import pytest
import torch

from conftest import make_examples, tiny_model
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.data.batch import build_batch
from prefixdpo.data.loader import stand_in_batch
from prefixdpo.dpo.loss_table import LossParams
from prefixdpo.dpo.reference import (AdapterReference, IdleReference, NoReference, SeparateModelReference)
from prefixdpo.dpo.step import Objective, pair_losses, zero_weight_loss


def _models(peft: bool):
    policy = tiny_model("llama")
    prepare_model(policy, "sdpa")
    if peft:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   lora_dropout=0.0, init_lora_weights=False))
        return policy, AdapterReference()
    reference = tiny_model("llama")
    prepare_model(reference, "sdpa")
    return policy, SeparateModelReference(reference)


def _calls(models: dict, run) -> list[tuple[str, str]]:
    """(model name, module name) of every module call `run()` makes, in order (LoRA layers: adapter on or off)."""
    calls, handles = [], []
    for who, model in models.items():
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(
                lambda m, args, who=who, name=name: calls.append((who, name))))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return calls


@pytest.mark.parametrize("case", ["plain", "sums-in-hand", "ld", "wpo", "no-reference", "lora"])
def test_an_idle_micro_batch_calls_what_a_real_one_calls(case):
    policy, reference = _models(peft=case == "lora")
    if case == "no-reference":
        reference = NoReference()
    params = LossParams(ld_alpha=0.5 if case == "ld" else None, use_weighting=case == "wpo")
    objective = Objective(("simpo" if case == "no-reference" else "sigmoid",), (1.0,), params)
    models = {"policy": policy, **({"reference": reference.model} if reference.model is not None else {})}
    real = build_batch(make_examples(3, seed=3, ks=(2, 3)))
    idle = stand_in_batch(pad_token_id=0)
    real_mask, idle_mask = plan_pass(real, "sdpa"), plan_pass(idle, "sdpa")
    in_hand = case == "sums-in-hand"
    real_sums = torch.zeros(real.num_responses) if in_hand else None
    idle_sums = torch.zeros(idle.num_responses) if in_hand else None

    # the first pass of a model checks our head path against its own once (`forward.compute_response_logps`):
    # done here, before the passes compared, as it is on every rank before an idle micro-batch
    pair_losses(policy, real, real_mask, reference=reference, objective=objective, ref_logps=real_sums)
    real_calls = _calls(models, lambda: pair_losses(policy, real, real_mask, reference=reference, objective=objective,
                                                    ref_logps=real_sums))
    idle_calls = _calls(models, lambda: zero_weight_loss(policy, idle, idle_mask, reference=IdleReference(reference),
                                                         objective=objective, ref_logps=idle_sums))
    assert idle_calls == real_calls
    # the reference ran (or did not) as the case says: its calls are the policy's model's again, or the other model's
    policy_calls = sum(who == "policy" for who, _ in real_calls)
    runs_reference = case not in ("sums-in-hand", "no-reference")
    assert len(real_calls) == (2 if runs_reference else 1) * policy_calls // (2 if case == "lora" else 1)

    loss = zero_weight_loss(policy, idle, idle_mask, reference=IdleReference(reference), objective=objective,
                            ref_logps=idle_sums)
    loss.backward()
    assert loss.item() == 0.0
    trained = [p for p in policy.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and not p.grad.any() for p in trained)


def test_the_idle_reference_answers_zeros_after_the_real_pass():
    policy, reference = _models(peft=False)
    idle = stand_in_batch(pad_token_id=0)
    mask = plan_pass(idle, "sdpa")
    calls = _calls({"reference": reference.model},
                   lambda: pytest.approx(0) == IdleReference(reference).sums(policy, idle, mask))
    assert calls and calls[0] == ("reference", "")  # the reference model itself was called
    sums = IdleReference(reference).sums(policy, idle, mask)
    assert sums.tolist() == [0.0, 0.0]  # one per response of the stand-in line
