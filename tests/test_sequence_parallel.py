"""Sequence parallelism (`core.sequence_parallel`): 2 gloo ranks holding each line between them (DeepSpeed's Ulysses
all-to-all around every attention call) against one process on the same lines.

Every logged metric of every step and the final weights must match: DPO with sigmoid (unpacked, gradient
checkpointing on, so every attention's all-to-all also runs in the recompute), a loss coupled across the step's
pairs (aot, packed), sigmoid + sft over 2 accumulated micro-batches with an evaluation, tries (`prefix_tree`), a
reward model, 2 x 2 ranks with DDP, FSDP2; the loss and rewards within K_FORWARD eps x `dpo_loss_scale`, logps
within K_FORWARD eps of their scale, grad_norm within K eps of itself, counts exactly; weights within K eps x
`weights_scale` (fp32, SGD). The one-line refusals are checked in-process.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from conftest import run_processes, tiny_model
from tolerances import K, assert_same_dpo_log, assert_within, weights_scale

BETA = 0.5

SCRIPT = textwrap.dedent(
    """
    import json, os, random, sys
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import finish_ranks, make_examples, tiny_model
    from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer

    import gc
    gc.freeze()
    out_dir, job = sys.argv[1], sys.argv[2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    sp = int(sys.argv[3])

    def flat(model):
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        return params[:: max(1, params.numel() // 3000)].tolist()

    def long_examples(n, seed):
        # prompts of 20-40 tokens, K = 2 or 3 responses of 5-20: every line's targets fall on both ranks
        from prefixdpo.data.example import Example
        g = random.Random(seed)
        out = []
        for i in range(n):
            k = 2 + i % 2
            prompt = [g.randrange(3, 96) for _ in range(g.randrange(20, 41))]
            responses = [[g.randrange(3, 96) for _ in range(g.randrange(5, 21))] for _ in range(k)]
            out.append(Example(prompt, responses, pairs=[(0, j) for j in range(1, k)], source_index=i))
        return out

    def tree_examples():
        sys.path.insert(0, {tests!r})
        from test_prefix_tree_training import k_response_records
        from test_tree import dialogue
        return k_response_records(prompts=3) + dialogue(random.Random(1), 3) + dialogue(random.Random(2), 3)

    CASES = {{
        "sigmoid": (lambda: long_examples(4, 0), dict(per_device_train_batch_size=2, gradient_checkpointing=True)),
        "small": (lambda: long_examples(4, 4), dict(per_device_train_batch_size=2)),
        "fsdp": (lambda: long_examples(4, 4), dict(per_device_train_batch_size=2, fsdp="full_shard auto_wrap",
                                                    fsdp_config={{"version": 2,
                                                                  "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}})),
        "aot-packed": (lambda: long_examples(6, 1), dict(loss_type=["aot"], packing=True, pack_length=128,
                                                          per_device_train_batch_size=1)),
        "sft-combo": (lambda: long_examples(4, 2), dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5],
                                                         per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                                         eval_strategy="epoch",
                                                         per_device_eval_batch_size=2)),
        "tree": (tree_examples, dict(packing=True, pack_length=48, prefix_tree=True, per_device_train_batch_size=2)),
    }}
    def reward_run(name, **kw):
        from test_reward_scores import tiny_reward_model
        from prefixdpo import PrefixRewardConfig, PrefixRewardTrainer
        args = PrefixRewardConfig(output_dir=os.path.join(out_dir, name), logging_steps=1, learning_rate=0.05,
                                  optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                                  disable_tqdm=True, seed=0, report_to="none", gradient_checkpointing=False,
                                  center_rewards_coefficient=0.01, ddp_backend="gloo" if world > 1 else None,
                                  num_train_epochs=1, sequence_parallel_size=sp, pad_to_multiple_of=2, **kw)
        t = PrefixRewardTrainer(model=tiny_reward_model("llama"), args=args, train_dataset=long_examples(6, 3))
        t.train()
        return {{"logs": [h for h in t.state.log_history if "loss" in h], "weights": flat(t.model)}}

    results = {{}}
    for name in job.split(","):
        if name.startswith("reward"):
            packed = dict(packing=True, pack_length=128) if name == "reward-packed" else {{}}
            results[name] = reward_run(name, per_device_train_batch_size=2, **packed)
            continue
        data, kw = CASES[name]
        kw = {{**kw, "per_device_train_batch_size": kw["per_device_train_batch_size"] // (world // sp)}}  # global
        reference = tiny_model("llama")
        with torch.no_grad():
            for p in reference.parameters():
                p.mul_(0.9)
        args = PrefixDPOConfig(output_dir=os.path.join(out_dir, name), logging_steps=1, learning_rate=0.5,
                               optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                               disable_tqdm=True, seed=0, beta={beta}, report_to="none",
                               ddp_backend="gloo" if world > 1 else None, num_train_epochs=1,
                               sequence_parallel_size=sp, pad_to_multiple_of=2,  # the same lines at any sp
                               **{{"gradient_checkpointing": False, **kw}})
        evals = long_examples(3, 9) if args.eval_strategy != "no" else None
        t = PrefixDPOTrainer(model=tiny_model("llama"), ref_model=reference, args=args, train_dataset=data(),
                             eval_dataset=evals)
        t.train()
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in t.model.parameters()]
        results[name] = {{"logs": [h for h in t.state.log_history if "loss" in h],
                          "evals": [h for h in t.state.log_history if "eval_loss" in h],
                          "weights": flat(torch.nn.ParameterList(params)), "engine": t.engine_description}}
    finish_ranks(rank, out_dir, results)
    """
)

# logged numbers compared by kind (the rest are clocks: runtime, per-second rates)
DPO_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
EXACT_KEYS = ("step", "epoch", "learning_rate", "rewards/accuracies", "prefix_sharing/tokens_saved",
              "packing/efficiency")
CLOCKS = ("pairs_per_second", "tokens_per_second", "train_runtime", "train_samples_per_second",
          "train_steps_per_second")


def run_script(tmp_path, nproc: int, job: str, sp: int) -> dict:
    script = tmp_path / "sp_script.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), beta=BETA))
    out = tmp_path / f"{job.replace(',', '+')}-np{nproc}-sp{sp}"
    out.mkdir()
    run_processes(nproc, str(script), str(out), job, str(sp))
    return json.loads((out / "result.json").read_text())


def assert_same_run(one: dict, other: dict, what: str, exact=EXACT_KEYS) -> None:
    """Every logged metric of every step, and the final weights, of `other` against `one` (module docstring)."""
    assert len(one["logs"]) == len(other["logs"]) >= 2, what
    worst = {"loss": 0.0, "weights": 0.0}
    for a, b in zip(one["logs"], other["logs"]):
        worst["loss"] = max(worst["loss"], abs(a["loss"] - b["loss"]))
        assert set(a) == set(b), (what, set(a) ^ set(b))
        assert_same_dpo_log(a, b, BETA, DPO_KEYS, slope=BETA + 1.0, what=f"{what} step {a['step']}")
        assert_within(b["grad_norm"], a["grad_norm"], a["grad_norm"], k=K, what=f"{what} grad_norm")
        for key in exact:
            assert b[key] == pytest.approx(a[key], rel=1e-12, abs=1e-12), (what, key)
        assert set(a) - set(DPO_KEYS) - set(EXACT_KEYS) - set(CLOCKS) == {"grad_norm"}, (what, sorted(a))  # all
    assert len(one["evals"]) == len(other["evals"])
    for a, b in zip(one["evals"], other["evals"]):  # evaluation: its loss, rewards and log-probs, and its counts
        assert_same_dpo_log(a, b, BETA, DPO_KEYS, prefix="eval_", slope=BETA + 1.0, what=f"{what} eval")
        for key in ("eval_rewards/accuracies", "eval_packing/efficiency", "eval_prefix_sharing/tokens_saved"):
            assert b[key] == pytest.approx(a[key], rel=1e-12, abs=1e-12), (what, key)
    params = torch.cat([p.detach().flatten() for p in tiny_model("llama").parameters()])
    start = params[:: max(1, params.numel() // 3000)]
    end = torch.tensor(one["weights"])
    assert (end - start).abs().max() > 1e-3, what  # training moved the weights
    assert_within(torch.tensor(other["weights"]), end, weights_scale(start, end), what=f"{what} weights")
    worst["weights"] = float((torch.tensor(other["weights"]) - end).abs().max())
    print(f"{what}: max |loss diff| {worst['loss']:.3g}, max |weight diff| {worst['weights']:.3g} "
          f"(weights' scale {weights_scale(start, end):.3g})")


@pytest.mark.parametrize("cases", ["sigmoid,aot-packed", "sft-combo,tree"])
def test_two_sequence_parallel_ranks_match_one_process(tmp_path, cases):
    one = run_script(tmp_path, 1, cases, 1)
    two = run_script(tmp_path, 2, cases, 2)
    for case in cases.split(","):
        assert_same_run(one[case], two[case], case)
        assert "sequence parallel: 1 group(s) of 2 ranks per line" in two[case]["engine"]
    if "sft-combo" in one:
        assert len(one["sft-combo"]["evals"]) == 1  # its evaluation ran, and was compared


def test_refusals_are_one_line_config_errors():
    from conftest import make_examples
    from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer, PrefixRewardConfig
    from prefixdpo.core import sequence_parallel
    from prefixdpo.errors import ConfigError

    base = dict(output_dir="unused", use_cpu=True, report_to="none")
    with pytest.raises(ConfigError, match="does not divide the 1 launched"):  # when the trainer builds the groups
        sequence_parallel.check_size(2)
    with pytest.raises(ConfigError, match="does not divide the 1 launched"):
        PrefixDPOTrainer(model=tiny_model("llama"), args=PrefixDPOConfig(sequence_parallel_size=2, **base),
                         train_dataset=make_examples(2))
    refused = {
        "prefix_reuse=true is not supported": dict(prefix_reuse=True),
        "pack_length=45 is not a multiple": dict(packing=True, pack_length=45),
        "precompute_ref_log_probs=True is not supported": dict(precompute_ref_log_probs=True),
        "pack_length auto .* does not split": dict(packing=True, size=3),
    }
    for message, options in refused.items():
        options = {"sequence_parallel_size": options.pop("size", 2), **options}
        with pytest.raises(ConfigError, match=message) as caught:
            PrefixDPOConfig(**base, **options)
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="must be >= 1"):
        PrefixRewardConfig(sequence_parallel_size=0, **base)
    model = tiny_model("llama")  # 4 attention heads, 2 key/value heads
    sequence_parallel.check_model(model, 2)
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        sequence_parallel.check_model(model, 3)
    with pytest.raises(ConfigError, match="does not divide the model's 2 key/value heads"):
        sequence_parallel.check_model(tiny_model("llama", num_attention_heads=8), 4)
    with pytest.raises(ConfigError, match="'sinks'"):  # attention sinks (gpt-oss) are per head: not split yet
        sequence_parallel.attention(None, None, None, None, None, None, None, sinks=torch.zeros(4))


def test_lines_pad_to_a_multiple_of_the_group():
    from conftest import make_examples
    from prefixdpo.data.batch import build_batch
    from prefixdpo.data.lines import padded

    batch = build_batch(make_examples(3, ks=(2, 3)))
    grown = padded(batch, 8, pad_token_id=1)
    L = batch.input_ids.shape[1]
    assert grown.input_ids.shape[1] % 8 == 0 and grown.input_ids.shape[1] >= L
    assert torch.equal(grown.input_ids[:, :L], batch.input_ids) and (grown.input_ids[:, L:] == 1).all()
    assert (grown.spans[:, L:] == -1).all() and (grown.position_ids[:, L:] == 0).all()
    assert torch.equal(grown.target_col, batch.target_col)
    assert padded(grown, 8) is grown


def test_reward_model_on_two_sequence_parallel_ranks_matches_one_process(tmp_path):
    from test_reward_scores import tiny_reward_model
    from test_reward_trainer import assert_same_reward_log

    cases = "reward,reward-packed"
    one = run_script(tmp_path, 1, cases, 1)
    two = run_script(tmp_path, 2, cases, 2)
    model = tiny_reward_model("llama")
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    start = params[:: max(1, params.numel() // 3000)]
    for case in cases.split(","):
        a_logs, b_logs = one[case]["logs"], two[case]["logs"]
        assert len(a_logs) == len(b_logs) >= 2
        for a, b in zip(a_logs, b_logs):
            assert set(a) == set(b)
            assert_same_reward_log(b, a, model, what=f"{case} step {a['step']}")
            for key in ("accuracy", "packing/efficiency", "prefix_sharing/tokens_saved", "epoch", "step"):
                assert b[key] == pytest.approx(a[key], rel=1e-12, abs=1e-12), (case, key)
        end = torch.tensor(one[case]["weights"])
        assert (end - start).abs().max() > 1e-4, case
        assert_within(torch.tensor(two[case]["weights"]), end, weights_scale(start, end), what=f"{case} weights")
        print(f"{case}: max |loss diff| {max(abs(a['loss'] - b['loss']) for a, b in zip(a_logs, b_logs)):.3g}, "
              f"max |weight diff| {float((torch.tensor(two[case]['weights']) - end).abs().max()):.3g}")


def test_sequence_parallel_times_data_parallel_matches_one_process(tmp_path):
    """4 gloo ranks: 2 data-parallel groups of 2 sequence-parallel ranks (DDP over all 4), against one process with
    the global batch (its one micro-batch pads both examples to the longer one, each data-parallel rank its own
    example: packing/efficiency is the one metric that differs, as with plain DDP)."""
    one = run_script(tmp_path, 1, "small", 1)
    four = run_script(tmp_path, 4, "small", 2)
    assert_same_run(one["small"], four["small"], "2 x 2 ranks", exact=tuple(set(EXACT_KEYS) - {"packing/efficiency"}))


def test_sequence_parallel_under_fsdp2_matches_one_process(tmp_path):
    """2 gloo ranks: one sequence-parallel group, its model sharded over the same 2 ranks by FSDP2."""
    one = run_script(tmp_path, 1, "small", 1)
    two = run_script(tmp_path, 2, "fsdp", 2)
    assert two["fsdp"]["engine"].startswith("FSDP2 over 2 processes"), two["fsdp"]["engine"]
    assert_same_run(one["small"], two["fsdp"], "FSDP2 x sequence parallel")
