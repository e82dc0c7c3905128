"""Prefix reuse under FSDP2 and DeepSpeed ZeRO-3 (2 gloo ranks, CPU, fp32) against one process.

FSDP2 and ZeRO-3 gather each layer's weights at each call of it, on every rank together, so every rank must make the
same model calls; prefix reuse makes as many as a rank's own lines need (a prefix pass and chunk passes per long
line, the chunks but the last recomputed in backward, one pass for the lines that fit). The ranks agree on the shape
of the passes (`prefix_reuse.agreed_shape`) and a rank with less runs stand-in passes that add exact zeros.

The data make the ranks' shapes differ at every step (budget 8 tokens a pass; global batch 4, 2 per rank, file order):
  step 1  rank 0: a line of 3 chunks and a line that fits whole   rank 1: lines of 1 and 2 chunks (nothing whole)
  step 2  rank 0: a line of 2 chunks                              rank 1: no example (a stand-in micro-batch)
Every logged metric within K_FORWARD eps x its magnitudes (`assert_same_dpo_log`) and the final weights within K eps x
`weights_scale` of one process with prefix reuse on, which itself equals one process with one row per example (no
reuse); the evaluation after the epoch too (its last micro-batch on rank 1 a stand-in); under FSDP2 also with
transformers' gradient checkpointing; the reward trainer on the same data under FSDP2 likewise
(`assert_same_reward_log`). Without the agreement the
FSDP2 run aborts in its first step (gloo: "Received data size doesn't match expected size"). And FSDP2's gathers
per pass, counted, with reshard_after_forward on and off (what docs/prefix-reuse.md says of them); and in one process,
the stand-in passes of a forced larger shape change no log-prob sum and no gradient (measured: exactly 0). Each launch also reports each pass's own and agreed shapes per rank, so the test
sees that the shapes differed and the passes agreed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import textwrap

import pytest
import torch
from conftest import run_rank_script
from tolerances import assert_same_dpo_log, assert_within, max_diff, weights_scale

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import FSDP2 as FSDP, ZERO3, finish_ranks, rank_script_start

    out_dir, engine, world, rank, init = rank_script_start(sys.argv)

    import gc
    from transformers import AutoModelForCausalLM, TrainerCallback
    from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer
    from prefixdpo.core import prefix_reuse
    from prefixdpo.core.engines import sharded_parameter_count
    from prefixdpo.core.engines_deepspeed import zero3_partition_counts
    from prefixdpo.core.model_checks import unwrap
    from prefixdpo.core.rank_decisions import gather
    from prefixdpo.data.example import Example

    gc.freeze()  # Trainer.train runs gc.collect(); what is imported so far need not be scanned each time
    shapes = []  # (this rank's own shape, the agreed one) of every prefix-reuse forward
    agreed_shape = prefix_reuse.agreed_shape

    def spy(reuse, device):
        own = ([plan is None for plan in reuse.plans], [0 if p is None else len(p.chunks) for p in reuse.plans])
        agreed = agreed_shape(reuse, device)
        shapes.append([own, [agreed[0], agreed[1]]])
        return agreed

    prefix_reuse.agreed_shape = spy

    def example(i, prompt, responses):
        ids = lambda n, s: [3 + (7 * i + 5 * s + 11 * t) % 90 for t in range(n)]
        return Example(ids(prompt, 0), [ids(n, k + 1) for k, n in enumerate(responses)],
                       pairs=[(0, k) for k in range(1, len(responses))], source_index=i)

    # budget 8: chunks of whole responses up to 8 tokens after the prompt (`reuse_plan.plan_line`)
    EXAMPLES = [example(0, 6, (5, 5, 5)),  # 3 chunks
                example(1, 5, (4, 3)),  # 12 tokens: 1 chunk
                example(2, 3, (2, 2)),  # 7 tokens: fits whole
                example(3, 4, (6, 5)),  # 2 chunks
                example(4, 7, (4, 5))]  # 2 chunks, alone in the last step

    def full_params(model):
        params = list(model.parameters())
        if hasattr(params[0], "ds_id"):
            import deepspeed
            with deepspeed.zero.GatheredParameters(params):
                return torch.cat([p.detach().flatten() for p in params]).tolist()
        return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
                          for p in params]).tolist()

    class Shards(TrainerCallback):
        # (parameters sharded (FSDP2) or partitioned (ZeRO-3), all parameters) at every step end
        def __init__(self):
            self.seen = []
        def on_step_end(self, args, state, control, model=None, **kw):
            policy = unwrap(model)
            counts = zero3_partition_counts(policy) if engine == "zero3" else sharded_parameter_count(policy)
            self.seen.append(tuple(counts))

    def run(name, evaluate=True, **kw):
        args = PrefixDPOConfig(output_dir=os.path.join(out_dir, name), logging_steps=1, learning_rate=0.5,
                               optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                               disable_tqdm=True, seed=0, beta=0.5, report_to="none",
                               ddp_backend="gloo" if world > 1 else None, per_device_train_batch_size=4 // world,
                               num_train_epochs=1, train_sampling_strategy="sequential",
                               eval_strategy="epoch" if evaluate else "no", per_device_eval_batch_size=4 // world,
                               **{{"gradient_checkpointing": False, **kw}})
        # loaded after the DeepSpeed config exists: under ZeRO-3, transformers loads it partitioned (zero.Init)
        model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
        # evaluated on the same examples after the epoch: no-grad passes, rank 1's last micro-batch a stand-in
        shards = Shards()
        t = PrefixDPOTrainer(model=model, train_dataset=EXAMPLES, eval_dataset=EXAMPLES, args=args, callbacks=[shards])
        t.train()
        policy = unwrap(t.model_wrapped)
        sharded = min(shards.seen)  # (sharded or partitioned parameters, all) at the step ends
        evals = [{{k[5:]: v for k, v in h.items() if k.startswith("eval_")}} for h in t.state.log_history
                 if "eval_loss" in h]
        return {{"logs": [h for h in t.state.log_history if "loss" in h], "evals": evals, "params": full_params(policy),
                 "engine": type(t.model_wrapped).__name__, "sharded": list(sharded)}}

    def reward_run(name, **kw):
        # the reward trainer's passes: scores at each response's end through the same core forward
        from prefixdpo import PrefixRewardConfig, PrefixRewardTrainer
        from test_reward_scores import tiny_reward_model
        args = PrefixRewardConfig(output_dir=os.path.join(out_dir, name), logging_steps=1, learning_rate=0.05,
                                  optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                                  disable_tqdm=True, seed=0, report_to="none", ddp_backend="gloo" if world > 1 else None,
                                  per_device_train_batch_size=4 // world, num_train_epochs=1,
                                  train_sampling_strategy="sequential", gradient_checkpointing=False, **kw)
        t = PrefixRewardTrainer(model=tiny_reward_model("llama"), train_dataset=EXAMPLES, args=args)
        t.train()
        policy = unwrap(t.model_wrapped)
        return {{"logs": [h for h in t.state.log_history if "loss" in h], "params": full_params(policy),
                 "sharded": list(sharded_parameter_count(policy))}}

    reuse = dict(prefix_reuse=True, max_tokens_per_pass="8")
    results = {{}}
    if engine == "none":
        results["one-row"] = run("one-row")
        shapes.clear()
    if engine != "fsdp-more":
        results["reused"] = run("reused", **reuse, **(FSDP if engine == "fsdp" else {{}}),
                                **({{"deepspeed": ZERO3}} if engine == "zero3" else {{}}))
    if engine == "fsdp-more":  # transformers' gradient checkpointing of each layer inside the chunks' own checkpoints
        results["reused-checkpointed"] = run("reused-checkpointed", evaluate=False, gradient_checkpointing=True,
                                             **reuse, **FSDP)
    if engine in ("none", "fsdp-more"):
        results["reward-reused"] = reward_run("reward-reused", **reuse, **(FSDP if world > 1 else {{}}))
    results["shapes"] = gather(shapes)
    finish_ranks(rank, out_dir, results)
    """
)


def _run(tmp_path, engine: str) -> dict:
    return run_rank_script(tmp_path, SCRIPT, engine, timeout=600)


GATHER_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from conftest import finish_ranks, tiny_model
    from torch.distributed.fsdp import fully_shard
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from prefixdpo.core.attention.pass_plan import plan_pass
    from prefixdpo.core.forward import compute_response_logps
    from prefixdpo.data.batch import build_batch
    from prefixdpo.data.example import Example

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    counts = {{"all_gather": 0, "reduce_scatter": 0}}
    gather, reduce = param_group.foreach_all_gather, param_group.foreach_reduce

    def counting_gather(*args, **kw):
        counts["all_gather"] += 1
        return gather(*args, **kw)

    def counting_reduce(*args, **kw):
        counts["reduce_scatter"] += 1
        return reduce(*args, **kw)

    param_group.foreach_all_gather, param_group.foreach_reduce = counting_gather, counting_reduce
    # rank 0: a prompt of 6 and 3 responses of 5 (3 chunks at 8 tokens a pass); rank 1: one chunk (and 2 stand-ins)
    responses = [list(range(10, 15)), list(range(20, 25)), list(range(30, 35))] if rank == 0 else [[10, 11], [20, 21]]
    batch = build_batch([Example(list(range(3, 9)), responses, pairs=[(0, 1)])])
    results = {{}}
    for reshard in (True, False):
        model = tiny_model("llama", attn_implementation="prefixdpo").train()
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        for budget in (8, 100):  # 100: the line fits one pass
            for key in counts:
                counts[key] = 0
            logps = compute_response_logps(model, batch, plan_pass(batch, "sdpa", max_tokens_per_pass=budget))
            forward = counts["all_gather"]
            logps.sums.sum().backward()
            results[f"{{reshard}}/{{budget}}"] = [forward, counts["all_gather"] - forward, counts["reduce_scatter"]]
    every = [None, None]
    dist.all_gather_object(every, results)
    finish_ranks(rank, sys.argv[1], every)
    """
)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reuse-sharded")
    return tmp, _run(tmp, "none")


def _same_training(base: dict, got: dict, what: str, evaluated: bool = True) -> dict:
    """`got` trained as `base` did: every logged metric, the evaluation's (where `evaluated`) and the final weights
    within bounds; -> the max diffs."""
    assert len(base["logs"]) == len(got["logs"]) == 2, what  # 5 examples, global batch 4: 4 + 1
    diffs = {}
    for a, b in zip(base["logs"], got["logs"]):
        assert_same_dpo_log(a, b, 0.5, METRICS, what=f"{what} step {a['step']}")
        for key in METRICS:
            diffs[key] = max(diffs.get(key, 0.0), max_diff(a[key], b[key]))
    assert len(base["evals"]) == 1 and len(got["evals"]) == int(evaluated), what
    for a, b in zip(base["evals"], got["evals"]):
        assert_same_dpo_log(a, b, 0.5, METRICS, what=f"{what} evaluation")
        diffs["eval"] = max(max_diff(a[key], b[key]) for key in METRICS)
    start = torch.cat([p.detach().flatten() for p in _initial_model().parameters()])
    end = torch.tensor(base["params"])
    assert end.numel() == len(got["params"]) == start.numel(), what
    assert_within(torch.tensor(got["params"]), end, weights_scale(start, end), what=f"{what} weights")
    diffs["weights"] = max_diff(got["params"], end)
    return diffs


def _same_reward_training(base: dict, got: dict) -> dict:
    """The reward runs: every logged metric (`assert_same_reward_log`) and the final weights within bounds, every
    parameter sharded under FSDP2; -> the max diffs."""
    from test_reward_scores import tiny_reward_model
    from test_reward_trainer import assert_same_reward_log

    model = tiny_reward_model("llama")
    assert len(base["logs"]) == len(got["logs"]) == 2
    sharded, params = got["sharded"]
    assert sharded == params > 0  # the score head too
    diffs = {}
    for a, b in zip(base["logs"], got["logs"]):
        assert_same_reward_log(a, b, model, what=f"reward step {a['step']}")
        for key in ("loss", "mean_reward", "margin"):
            diffs[key] = max(diffs.get(key, 0.0), max_diff(a[key], b[key]))
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    end = torch.tensor(base["params"])
    assert_within(torch.tensor(got["params"]), end, weights_scale(start, end), what="reward weights")
    diffs["weights"] = max_diff(got["params"], end)
    return diffs


def _initial_model():
    from conftest import tiny_model

    return tiny_model("llama")


def _check_shapes(shapes: list) -> None:
    """Both ranks ran the same agreed passes, and their own shapes differed at the steps the data set up."""
    assert len(shapes) == 2 and len(shapes[0]) == len(shapes[1]) > 0
    own_differ = 0
    for (own0, agreed0), (own1, agreed1) in zip(*shapes):
        assert agreed0 == agreed1
        own_differ += own0 != own1
    assert own_differ == len(shapes[0])  # every pass: the ranks' own shapes differed
    owns = {json.dumps(own) for own, _ in shapes[1]}
    # rank 1: lines of 1 and 2 chunks (step 1), and the stand-in micro-batch (step 2: one line that fits)
    assert owns == {json.dumps([[False, False], [1, 2]]), json.dumps([[True], [0]])}, owns
    agreed = {json.dumps(a) for _, a in shapes[0]}
    assert agreed == {json.dumps([True, [3, 2]]), json.dumps([True, [2]])}, agreed


def test_prefix_reuse_in_one_process_equals_one_row(one_process):
    _, one = one_process
    diffs = _same_training(one["one-row"], one["reused"], "one process, reused vs one row")
    print("one process, reused vs one row, max diffs:", diffs)
    assert one["reused"]["logs"][-1]["loss"] != pytest.approx(one["reused"]["logs"][0]["loss"], rel=1e-3)  # trained


def test_prefix_reuse_fsdp2_two_ranks_equal_one_process(one_process):
    tmp, one = one_process
    two = _run(tmp, "fsdp")
    assert two["reused"]["engine"] == "FSDPLlamaForCausalLM", two["reused"]["engine"]
    sharded, params = two["reused"]["sharded"]
    assert sharded == params > 0  # every parameter a DTensor sharded over the 2 ranks
    _check_shapes(two["shapes"])
    diffs = _same_training(one["reused"], two["reused"], "FSDP2")
    print("FSDP2 2 ranks vs 1 process, max diffs:", diffs)


def test_prefix_reuse_fsdp2_with_gradient_checkpointing_and_a_reward_model(one_process):
    tmp, one = one_process
    two = _run(tmp, "fsdp-more")
    _check_shapes(two["shapes"])
    sharded, params = two["reused-checkpointed"]["sharded"]
    assert sharded == params > 0
    diffs = _same_training(one["reused"], two["reused-checkpointed"], "FSDP2 gradient checkpointing", evaluated=False)
    print("FSDP2 with gradient checkpointing, max diffs:", diffs)
    print("FSDP2 reward model, max diffs:", _same_reward_training(one["reward-reused"], two["reward-reused"]))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_prefix_reuse_zero3_two_ranks_equal_one_process(one_process):
    tmp, one = one_process
    two = _run(tmp, "zero3")
    assert two["reused"]["engine"] == "DeepSpeedEngine", two["reused"]["engine"]
    partitioned, params = two["reused"]["sharded"]
    assert partitioned == params > 0  # every policy parameter holds only its partition on the rank
    _check_shapes(two["shapes"])
    diffs = _same_training(one["reused"], two["reused"], "ZeRO-3")
    print("ZeRO-3 2 ranks vs 1 process, max diffs:", diffs)


def test_fsdp2_gathers_each_layer_once_per_pass(tmp_path):
    """The all-gathers docs/prefix-reuse.md counts: 3 FSDP2 units (2 layers, the root), a prompt and 3 chunks on one
    rank, 1 chunk (and 2 stand-ins) on the other: 4 passes on both. reshard_after_forward: each layer gathered once
    per pass in forward and once per pass in backward (the root once each); off: once in forward, again in backward
    for every pass after the first. Gradients reduce-scattered once per unit either way."""
    from conftest import run_processes

    script = tmp_path / "gathers.py"
    script.write_text(GATHER_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    run_processes(2, str(script), str(tmp_path))
    rank0, rank1 = json.loads((tmp_path / "result.json").read_text())
    assert rank0 == rank1  # the same collectives on both ranks
    # [all-gathers in forward, in backward, reduce-scatters]
    assert rank0 == {"True/8": [1 + 2 * 4, 1 + 2 * 4, 3], "True/100": [3, 3, 3],
                     "False/8": [3, 2 * 3, 3], "False/100": [3, 0, 3]}, rank0


@pytest.mark.parametrize("backend", ["sdpa", "segmented"])
def test_stand_in_passes_change_no_sum_and_no_gradient(monkeypatch, backend):
    """In one process, the agreed shape forced larger than the batch's own (`max_over_ranks` made to answer what a
    rank with more would: a whole pass, a chunk more per line, a third reused line of 2 chunks): the stand-in passes
    run (counted) and the log-prob sums and every gradient are those of the batch's own passes, within K_FORWARD eps
    (their outputs are added as exact zeros). With a line that fits (budget 35), the stand-in whole pass is not
    needed; with all lines reused (budget 15), it runs."""
    from dataclasses import replace

    import prefixdpo.core.model_call as model_call
    import prefixdpo.core.prefix_reuse as prefix_reuse
    from conftest import tiny_model
    from prefixdpo.core.attention.pass_plan import reuse_pass_plan
    from prefixdpo.core.attention.reuse_plan import plan_reuse
    from prefixdpo.core.model_checks import prepare_model
    from prefixdpo.data.batch import build_batch
    from test_prefix_reuse import _examples, _sums_and_grads
    from tolerances import K_FORWARD

    model = tiny_model("llama")
    prepare_model(model, backend)
    batch = build_batch(_examples(), pad_multiple=8)
    calls = []  # the tokens of each model call (`model_call.model_pass`, which every pass of prefix reuse runs)
    original = model_call.model_pass
    monkeypatch.setattr(model_call, "model_pass", lambda *a, **k: calls.append(a[2].shape[1])
                        or original(*a, **k))
    for budget in (15, 35):
        own = plan_reuse(batch.spans, budget, backend)
        calls.clear()
        sums, grads = _sums_and_grads(model, batch, reuse_pass_plan(batch.spans, own))
        own_calls = list(calls)
        answers = iter([[1, 3], [len(p.chunks) + 1 for p in own.plans if p is not None] + [2]])
        if budget == 35:  # one reused line: the agreed second line and the third are stand-ins
            answers = iter([[1, 3], [len(own.plans[0].chunks) + 1, 1, 2]])
        monkeypatch.setattr(prefix_reuse, "max_over_ranks", lambda values, device: next(answers))
        calls.clear()
        a_sums, a_grads = _sums_and_grads(model, batch, reuse_pass_plan(batch.spans, replace(own, aligned=True)))
        stand_ins = [n for n in calls if n == 1]
        assert len(calls) > len(own_calls) and len(stand_ins) >= 3, (own_calls, calls)
        assert_within(a_sums, sums, sums.abs().max().item(), k=K_FORWARD, what=f"budget {budget} sums")
        assert_within(a_grads, grads, grads.abs().max().item(), k=K_FORWARD, what=f"budget {budget} gradients")
        print(f"{backend} budget {budget}: calls {own_calls} -> {calls}; max diffs sums "
              f"{max_diff(a_sums, sums):.3g}, gradients {max_diff(a_grads, grads):.3g}")
