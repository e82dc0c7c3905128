"""Prefix reuse (`core.prefix_reuse`): a line over `max_tokens_per_pass` runs its prefix once and its responses in
chunks against the prefix's per-layer K/V, with the same log-probs and gradients as the one-row pass.

- One pass: every response's log-prob sum and every parameter's gradient of a weighted sum of them equal the one-row
  pass over 1 to 5 chunks, on Llama, Qwen2 (GQA), Gemma (MQA), GPT-2 and Mixtral (MoE), with the dense-mask SDPA and
  the segment plan. In float64 the difference is rounding of float64 (<= 1e-10 x the scale), so the fp32 bound
  (1e-5 x the scale, ~100 x eps32: sums over tens of tokens and two layers) is float rounding only. Gemma's RMSNorm
  computes in float32 whatever the model's dtype (`x.float()`), so its norm weights' gradients are summed in float32
  in both passes, in other orders: its float64 bound is float32's.
- A reference pass (no gradient) runs each chunk once and nothing is recomputed; flex (forward only on CPU) too.
- Training: one SGD step of DPO with prefix reuse equals the one-row step (loss, gradient) with a coupled loss
  (sft, bco_pair), a precomputed reference and an adapter-off (LoRA) reference, with gradient checkpointing on; a
  reward model's step too; GRPO with prefix reuse equals TRL's GRPOTrainer step by step.
- Refused in one line: packing, the MoE load-balancing loss.
About 30 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from prefixdpo.core.attention.pass_plan import plan_pass, reuse_pass_plan
from prefixdpo.core.attention.reuse_plan import PrefixReuse, plan_line, plan_reuse
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo.errors import ConfigError
from tolerances import assert_within, sgd_grad_scale

EPS32 = torch.finfo(torch.float32).eps
ARCHS = {"llama": {}, "qwen2": {}, "gemma": {"head_dim": 8, "num_key_value_heads": 1}, "gpt2": {},
         "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "num_key_value_heads": 2}}


def _examples(seed: int = 1) -> list[Example]:
    """Two prompts of 24 and 17 tokens with 5 and 3 responses of 1-12 tokens: lines of 59 and 33 tokens."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, 90, (n,), generator=g).tolist()

    return [Example(ids(24), [ids(7), ids(12), ids(1), ids(11), ids(4)], pairs=((0, 1), (2, 3), (4, 0))),
            Example(ids(17), [ids(5), ids(9), ids(2)], pairs=((1, 0), (2, 1)))]


def _sums_and_grads(model, batch, plan):
    model.zero_grad()
    out = compute_response_logps(model, batch, plan)
    weights = torch.linspace(1.0, 2.0, out.sums.numel(), dtype=out.sums.dtype)
    (out.sums * weights).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.sums.detach(), grads


def test_plan_cuts_after_the_prefix_into_chunks_of_whole_responses():
    batch = build_batch(_examples(), pad_multiple=8)
    plan = plan_line(batch.spans[0], 0, 13)
    assert plan.prefix == 24
    # responses [24, 31), [31, 43), [43, 44), [44, 55), [55, 59): whole, at most 13 tokens a chunk (12 + 1 together)
    assert plan.chunks == ((24, 31), (31, 44), (44, 55), (55, 59))
    assert plan_line(batch.spans[0], 0, 59) is None  # the line fits one pass
    assert plan_line(batch.spans[0], 0, 1).chunks == ((24, 31), (31, 43), (43, 44), (44, 55), (55, 59))
    packed = build_batch(_examples(), packs=[[0, 1]])
    with pytest.raises(ConfigError, match="share no prefix"):
        plan_line(packed.spans[0], 0, 40)
    assert isinstance(plan_pass(batch, "sdpa", max_tokens_per_pass=13).reuse, PrefixReuse)
    assert plan_pass(batch, "sdpa", max_tokens_per_pass=60).reuse is None


# budgets of 1, 13, 15, 24 and 35 tokens cut the first line (59 tokens) into 5 to 1 chunks; the second (33) is
# reused too, or, at 35, runs whole beside it
ALL_BUDGETS = {1: 5, 13: 4, 15: 3, 24: 2, 35: 1}
CASES = [("llama", "sdpa", ALL_BUDGETS), ("llama", "segmented", {1: 5, 24: 2}),
         *((arch, "sdpa", {1: 5, 15: 3}) for arch in ARCHS if arch != "llama")]


@pytest.fixture
def reused_passes(monkeypatch):
    """How many passes ran their lines by prefix reuse (a list that grows by one per such pass)."""
    import prefixdpo.core.one_pass as one_pass

    calls = []
    original = one_pass.reused_hidden_states
    monkeypatch.setattr(one_pass, "reused_hidden_states", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("arch, backend, budgets", CASES, ids=[f"{a}-{b}" for a, b, _ in CASES])
def test_reused_prefix_gives_the_one_row_sums_and_gradients(arch, backend, budgets):
    """fp32 and float64, against the one-row pass of the same model."""
    for dtype in (torch.float32, torch.float64):
        model = tiny_model(arch, **ARCHS[arch])
        if dtype == torch.float64 and arch == "mixtral":
            model.set_experts_implementation("eager")  # the grouped-matmul kernel has no float64
        model = model.to(dtype)
        prepare_model(model, backend)
        batch = build_batch(_examples(), pad_multiple=8)
        sums, grads = _sums_and_grads(model, batch, plan_pass(batch, backend))
        scale, grad_scale = sums.abs().max().item(), grads.abs().max().item()
        assert grad_scale > 1e-2
        norm_in_fp32 = arch == "gemma"  # module docstring
        bound = 1e-5 if dtype == torch.float32 or norm_in_fp32 else 1e-10
        for budget, chunks in budgets.items():
            reuse = plan_reuse(batch.spans, budget, backend)
            assert len(reuse.plans[0].chunks) == chunks and (reuse.plans[1] is None) == (budget >= 33)
            r_sums, r_grads = _sums_and_grads(model, batch, reuse_pass_plan(batch.spans, reuse))
            assert (r_sums - sums).abs().max().item() <= bound * scale, (dtype, budget)
            assert (r_grads - grads).abs().max().item() <= bound * grad_scale, (dtype, budget)


@pytest.mark.parametrize("backend", ["sdpa", "segmented"])
def test_a_no_grad_pass_runs_each_chunk_once(backend, monkeypatch):
    """The reference's pass: prefix once, each chunk once (no checkpoint, nothing recomputed), sums as one row.
    (Flex's chunk masks have fewer queries than keys, which torch 2.13's CPU flex kernel fails to compile:
    `make gpu-check` runs them on CUDA.)"""
    import prefixdpo.core.prefix_reuse as reuse_module

    model = tiny_model("llama")
    prepare_model(model, backend)
    batch = build_batch(_examples(), pad_multiple=8)
    calls = []
    original = reuse_module.checkpoint
    monkeypatch.setattr(reuse_module, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        one = compute_response_logps(model, batch, plan_pass(batch, backend)).sums
        reused = compute_response_logps(model, batch, plan_pass(batch, backend, max_tokens_per_pass=8)).sums
    assert not calls
    assert (reused - one).abs().max().item() <= 1e-5 * one.abs().max().item()


def test_moe_load_balancing_loss_is_refused_with_prefix_reuse():
    model = tiny_model("mixtral", **ARCHS["mixtral"])
    prepare_model(model, "sdpa")
    batch = build_batch(_examples())
    with pytest.raises(ConfigError, match="prefix_reuse does not compute the MoE load-balancing loss"):
        compute_response_logps(model, batch, plan_pass(batch, "sdpa", max_tokens_per_pass=8), router_aux=True)


def test_prefix_reuse_options_are_checked_in_one_line(tmp_path):
    from prefixdpo import PrefixDPOConfig

    with pytest.raises(ConfigError, match="runs examples unpacked"):
        PrefixDPOConfig(output_dir=str(tmp_path), use_cpu=True, prefix_reuse=True, packing=True)
    with pytest.raises(ConfigError, match="no effect without prefix_reuse"):
        PrefixDPOConfig(output_dir=str(tmp_path), use_cpu=True, max_tokens_per_pass="64")
    with pytest.raises(ConfigError, match="expected 'auto' or a number of tokens"):
        PrefixDPOConfig(output_dir=str(tmp_path), use_cpu=True, prefix_reuse=True, max_tokens_per_pass="lots")
    assert PrefixDPOConfig(output_dir=str(tmp_path), use_cpu=True, prefix_reuse=True,
                           max_tokens_per_pass="64").max_tokens_per_pass == 64


# ---- training ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["coupled-precomputed", "lora-adapter-off"])
def test_one_dpo_step_with_prefix_reuse_equals_the_one_row_step(tmp_path, case, reused_passes):
    """Records of K = 3 and 4 responses and several pairs each behind a 10-token system prompt, one SGD step with
    every record in one micro-batch, gradient checkpointing on: sigmoid + sft + bco_pair (coupled across the step's
    pairs) against a precomputed reference, or sigmoid with LoRA (the adapter-off reference)."""
    from peft import LoraConfig
    from test_prefix_tree_training import _one_step_on, _same_step, k_response_records

    examples = k_response_records()
    if case == "coupled-precomputed":
        options = dict(loss_type=["sigmoid", "sft", "bco_pair"], loss_weights=[1.0, 0.5, 0.5],
                       precompute_ref_log_probs=True, gradient_checkpointing=True)
        step = lambda name, **kw: _one_step_on(tmp_path, name, examples,  # noqa: E731
                                               ref_cache_dir=str(tmp_path / f"cache-{name}"), **options, **kw)
    else:
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=False)
        step = lambda name, **kw: _one_step_on(tmp_path, name, examples, peft_config=lora,  # noqa: E731
                                               gradient_checkpointing=True, **kw)
    one_row = step("one-row")
    assert not reused_passes
    reused = step("reused", prefix_reuse=True, max_tokens_per_pass="6")
    assert len(reused_passes) >= 2  # the reference's pass and the policy's, at least
    _same_step(reused, one_row)


def test_one_reward_model_step_with_prefix_reuse_equals_the_one_row_step(tmp_path, reused_passes):
    from test_reward_trainer import assert_same_reward_log, flat, tiny_reward_model, train

    from test_prefix_tree_training import k_response_records

    examples = k_response_records()
    step = dict(max_steps=1, learning_rate=10.0, max_grad_norm=0, per_device_train_batch_size=len(examples))
    one_row, (o_log,) = train(tmp_path, "one-row", examples, **step)
    reused, (r_log,) = train(tmp_path, "reused", examples, prefix_reuse=True, max_tokens_per_pass="6", **step)
    assert reused_passes
    assert_same_reward_log(r_log, o_log, one_row.model, what="prefix reuse")
    start = flat(tiny_reward_model("llama"))
    o_grad, r_grad = ((start - flat(t.model)) / 10.0 for t in (one_row, reused))
    assert o_grad.abs().max().item() > 1e-4
    assert_within(r_grad, o_grad, sgd_grad_scale(o_grad, start, 10.0), what="gradient")


def test_grpo_with_prefix_reuse_equals_trl(tmp_path, reused_passes):
    """4 steps of GRPO (G = 4, beta 0.04, so the reference pass runs reused too) with a 16-token budget: every
    prompt of ~25 tokens with its completions runs as a prefix and chunks; every metric and the final weights as
    TRL's GRPOTrainer (test_grpo_trl_parity's comparison)."""
    from grpo_common import saved_tiny_model
    from test_grpo_trl_parity import compare, run
    from trl import GRPOConfig, GRPOTrainer

    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer

    model_dir = saved_tiny_model(tmp_path / "model")
    options = dict(beta=0.04, num_generations=4, per_device_train_batch_size=4)
    theirs = run(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **options)
    ours = run(PrefixGRPOTrainer, PrefixGRPOConfig, model_dir, tmp_path / "ours", prefix_reuse=True,
               max_tokens_per_pass="16", **options)
    assert len(reused_passes) >= 8  # every step's policy and reference passes
    compare(theirs, ours)


def test_passes_over_the_budget_are_said_once_and_counted(caplog):
    """The budget splits the responses after a prefix; a prefix or a single response longer than it runs whole
    (`reuse_plan.OverBudget`): a warning at the first such line (what, how many tokens, by how much), then counted."""
    from prefixdpo.core.attention.reuse_plan import OVER_BUDGET

    OVER_BUDGET.reset()
    long_response = build_batch([Example([5, 6, 7, 8], [list(range(10, 22)), [30, 31, 32]], pairs=((0, 1),))])
    assert plan_reuse(build_batch(_examples()).spans, 24, "sdpa") is not None  # prefixes of 24 and 17: within it
    assert OVER_BUDGET.summary() is None
    with caplog.at_level("WARNING", logger="prefixdpo.core.attention.reuse_plan"):
        plan_reuse(long_response.spans, 8, "sdpa")
        plan_reuse(build_batch(_examples()).spans, 8, "sdpa")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "prefix reuse: a single response of 12 tokens runs in one pass, 4 over max_tokens_per_pass=8"]
    assert OVER_BUDGET.summary().startswith("Prefix reuse: 3 lines ran a pass over max_tokens_per_pass=8 (the "
                                            "largest: a shared prefix (prompt) of 24 tokens, 16 over;")
    OVER_BUDGET.reset()


def test_reused_tokens_from_lengths_are_the_plans():
    """`reused_tokens` (what `inspect` reports, from lengths) is the prompt plus the plan's largest chunk."""
    from prefixdpo.core.attention.reuse_plan import reused_tokens

    for example in _examples():
        row = build_batch([example])
        for budget in (1, 9, 13, 20, 200):
            plan = plan_line(row.spans[0], 0, budget)
            expected = example.shared_length if plan is None else plan.prefix + max(b - a for a, b in plan.chunks)
            assert reused_tokens(len(example.prompt_ids), [len(r) for r in example.response_ids], budget) == expected


def test_inspect_reports_the_activations_with_and_without_prefix_reuse(tmp_path, capsys):
    import json

    from prefixdpo.cli import main
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(str(tmp_path / "tok"))
    data = tmp_path / "d.jsonl"
    records = [{"prompt": "the cat sat on the mat " * 40, "chosen": " a dog ran", "rejected": " no"} for _ in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["inspect", str(data), "--tokenizer", str(tmp_path / "tok"), "--max-tokens-per-pass", "8"]) == 0
    out = capsys.readouterr().out
    (one_row,) = [line for line in out.splitlines() if line.startswith("activations ")]
    (reused,) = [line for line in out.splitlines() if "with --prefix_reuse at 8 tokens a pass" in line]
    largest = lambda line: float(line.split("largest ")[1].split(" GiB")[0])  # noqa: E731
    assert 0 < largest(reused) < largest(one_row) and "3 of 3 examples run as a prefix and chunks" in reused


def test_bench_task_reuse_runs_the_three_modes_to_the_same_gradient(tmp_path, capsys):
    """(~5 s) `prefixdpo bench --task reuse` at a fiftieth of the full lengths: one row, a row per pair and prefix
    reuse each report their time, activations and peak memory, and their first steps' gradient norms agree."""
    from prefixdpo.cli import main

    assert main(["bench", "--task", "reuse", "--quick", "--length-scale", "0.02", "--examples", "1", "--repeats", "1",
                 "--threads", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in ("one-row", "split", "reused")}
    assert set(rows) == {"one-row", "split", "reused"}
    norms = {mode: float(cells[-2]) for mode, cells in rows.items()}
    assert max(norms.values()) - min(norms.values()) <= 1e-5 * max(norms.values())  # the same gradient, 3 ways
    assert "faster than split" in out and (tmp_path / "bench-reuse.md").is_file()
