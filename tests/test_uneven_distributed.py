"""Rank-balancing empty micro-batches over 2 gloo ranks: a coupled loss's pre-pass and evaluation.

When a step (or the eval set) has fewer micro-batches' worth of data than ranks, a rank gets an empty micro-batch.
It must run the passes a real micro-batch runs, in the same order, at zero weight: FSDP2 gathers a unit's weights at
each call, DDP broadcasts buffers at each call of its wrapper, so a rank that runs other passes than its peers
mismatches their collectives (gloo: "Detected mismatch between collectives", or a hang).

The data: 3 DPO records, one per micro-batch (packing off): a global batch of 2 makes 2 optimizer steps, the last
one uneven (the second rank's micro-batch is empty); the eval set of 3 records gives the second rank an empty
second eval micro-batch. Each case trains (SGD, fp32) then evaluates, and is compared with one process holding the
same global batch (`tolerances`): every logged step's loss and metrics and the eval metrics within K_FORWARD eps of
their magnitudes (`assert_same_dpo_log`, slope 1 + L for aot and sft; reward logs `assert_same_reward_log`; not the
accuracies: a tie could flip one; not a coupled loss's eval_loss, which follows the eval micro-batches by design),
the final trainable weights within K eps x `weights_scale`.

Cases: `aot` (its pre-pass runs the reference, then the policy, over every micro-batch of the step; the training pass
then runs the policy only) with a separate reference model under FSDP2 and with LoRA (adapter-off reference)
under FSDP2 and under DDP; `sigmoid,sft` (coupled through the data, no pre-pass) under FSDP2; plain `sigmoid` under
FSDP2 (evaluation's eval_loss); a reward model under FSDP2 (its empty micro-batch scores the stand-in through the
head, in training and evaluation). Two launches (1 process, 2 processes), about 60 s on 2 busy CPU cores.
"""

from __future__ import annotations

import json
import os
import re
import textwrap

import pytest
import torch
from conftest import run_processes, tiny_model
from test_reward_scores import tiny_reward_model
from test_reward_trainer import assert_same_reward_log
from tolerances import assert_same_dpo_log, assert_within, weights_scale

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import make_examples, finish_ranks
    from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer
    from prefixdpo.core.model_checks import unwrap

    import gc
    gc.freeze()  # Trainer.train runs gc.collect(); what is imported so far need not be scanned each time
    out_dir, init, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    train, evals = make_examples(3, seed=1, ks=(2, 3)), make_examples(3, seed=2, ks=(3, 2))
    FSDP = dict(fsdp="full_shard auto_wrap",
                fsdp_config={{"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}})

    def lora():
        from peft import LoraConfig
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=False)

    def weights(model):
        # every trainable parameter whole (an FSDP2 DTensor's full tensor), subsampled
        params = [p for p in unwrap(model).parameters() if p.requires_grad]
        flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten() for p in params])
        return flat[:: max(1, flat.numel() // 3000)].tolist()

    def run(name, loss_type, peft=False, engine=None):
        from transformers import AutoModelForCausalLM
        args = PrefixDPOConfig(output_dir=os.path.join(out_dir, name), logging_steps=1, learning_rate=0.5,
                               optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                               disable_tqdm=True, seed=0, beta=0.5, report_to="none", loss_type=loss_type,
                               ddp_backend="gloo" if world > 1 else None, gradient_checkpointing=False,
                               num_train_epochs=1, per_device_train_batch_size=2 // world,
                               per_device_eval_batch_size=2 // world, packing=False,
                               **(FSDP if engine == "fsdp" and world > 1 else {{}}))
        policy = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
        reference = None
        if not peft:  # a reference that is not the policy
            reference = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
            with torch.no_grad():
                for p in reference.parameters():
                    p.mul_(0.9)
        t = PrefixDPOTrainer(model=policy, ref_model=reference, peft_config=lora() if peft else None, args=args,
                             train_dataset=train, eval_dataset=evals)
        initial = weights(t.model_wrapped)
        t.train()
        return {{"logs": [h for h in t.state.log_history if "loss" in h], "eval": t.evaluate(), "initial": initial,
                 "weights": weights(t.model_wrapped), "engine": t.engine_description}}

    def reward(name):
        from prefixdpo import PrefixRewardConfig, PrefixRewardTrainer
        from test_reward_scores import tiny_reward_model
        args = PrefixRewardConfig(output_dir=os.path.join(out_dir, name), logging_steps=1, learning_rate=0.05,
                                  optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                                  disable_tqdm=True, seed=0, report_to="none", gradient_checkpointing=False,
                                  ddp_backend="gloo" if world > 1 else None, num_train_epochs=1,
                                  per_device_train_batch_size=2 // world, per_device_eval_batch_size=2 // world,
                                  packing=False, **(FSDP if world > 1 else {{}}))
        t = PrefixRewardTrainer(model=tiny_reward_model("llama"), args=args, train_dataset=train, eval_dataset=evals)
        initial = weights(t.model_wrapped)
        t.train()
        return {{"logs": [h for h in t.state.log_history if "loss" in h], "eval": t.evaluate(), "initial": initial,
                 "weights": weights(t.model_wrapped), "engine": t.engine_description}}

    CASES = {{"aot-fsdp": dict(loss_type=["aot"], engine="fsdp"),
              "aot-lora-fsdp": dict(loss_type=["aot"], peft=True, engine="fsdp"),
              "aot-lora-ddp": dict(loss_type=["aot"], peft=True),
              "sft-fsdp": dict(loss_type=["sigmoid", "sft"], engine="fsdp"),
              "eval-fsdp": dict(loss_type=["sigmoid"], engine="fsdp")}}
    results = {{name: reward(name) if name == "reward-fsdp" else run(name, **CASES[name]) for name in names}}
    finish_ranks(rank, out_dir, results)
    """
)

CASES = ("aot-fsdp", "aot-lora-fsdp", "aot-lora-ddp", "sft-fsdp", "eval-fsdp", "reward-fsdp")
# logged per step and independent of the world size (not throughput, not the accuracies: a tie could flip one)
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
REWARD_COMPARED = ("loss", "margin", "mean_reward", "min_reward", "max_reward")
TIMEOUT = 300  # a hang (collectives that do not line up) fails here, not after pytest's patience


def launch(tmp, nproc: int, cases=CASES) -> dict:
    """{case: result} of one launch of `cases` over `nproc` processes."""
    script = tmp / "uneven_script.py"
    if not script.exists():
        script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
        tiny_model("llama").save_pretrained(str(tmp / "init"))
    out = tmp / f"{nproc}-{'-'.join(cases)}"
    out.mkdir()
    run_processes(nproc, str(script), str(out), str(tmp / "init"), ",".join(cases), timeout=TIMEOUT)
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process's results, two ranks' results)."""
    tmp = tmp_path_factory.mktemp("uneven")
    return launch(tmp, 1), launch(tmp, 2)


def _close(a: dict, b: dict, keys, case: str, prefix: str = "") -> float:
    """Asserts `b` logged what `a` did on `keys` (without `prefix`), as the module doc says; returns the worst
    difference in eps x its scale."""
    if case.startswith("reward"):
        assert_same_reward_log({k: b[prefix + k] for k in keys}, {k: a[prefix + k] for k in keys},
                               tiny_reward_model("llama"), what=case)
        return 0.0
    return assert_same_dpo_log(a, b, 0.5, keys, prefix, slope=1 + abs(a[prefix + "loss"]) if prefix + "loss" in a
                               else None, what=case)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_with_an_empty_micro_batch_equal_one_process(runs, case):
    one, two = runs[0][case], runs[1][case]
    engine = two["engine"]
    if case.endswith("fsdp"):
        assert re.match(r"FSDP2 over 2 processes: (\d+) of \1 parameters sharded", engine), engine
    else:
        assert "over 2 processes" in engine and "FSDP" not in engine, engine
    assert len(one["logs"]) == len(two["logs"]) == 2  # 2 + 1 records: the second step is uneven
    keys = REWARD_COMPARED if case.startswith("reward") else COMPARED
    worst = max(_close(a, b, keys, case) for a, b in zip(one["logs"], two["logs"]))
    assert one["logs"][0]["loss"] != pytest.approx(one["logs"][1]["loss"], rel=1e-3)  # the steps really differ
    # a coupled loss evaluates each micro-batch with its own pairs' context (`StepCoupling.for_evaluation`), so its
    # eval_loss follows how the eval set is cut into micro-batches: compared where the loss is not coupled
    eval_keys = [k for k in keys if k != "loss" or not case.startswith(("aot", "sft"))]
    worst = max(worst, _close(one["eval"], two["eval"], eval_keys, case, "eval_"))
    assert len(one["weights"]) == len(two["weights"]) > 100
    start, end = torch.tensor(one["initial"]), torch.tensor(one["weights"])
    worst_weight = assert_within(torch.tensor(two["weights"]), end, weights_scale(start, end), what="weights")
    print(f"{case}: largest metric difference {worst:.3g}, weight difference {worst_weight:.3g}")
