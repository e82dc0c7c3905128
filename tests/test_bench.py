"""prefixdpo bench: every mode computes what stock separate passes compute, layouts are sound, a tiny run
finishes."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import tiny_model
from prefixdpo_tools.bench.modes import MODES, bucket_length, common_pack_length, layout_group
from prefixdpo_tools.bench.step import DPOStep
from prefixdpo_tools.bench.workloads import fixed_groups, synthetic_workload
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.dpo.losses import sigmoid_loss
from prefixdpo.core.verify import separate_pass_logps
from prefixdpo.errors import ConfigError
from tolerances import K_FORWARD, assert_within

BETA = 0.1


@pytest.fixture(scope="module")
def workload():
    # lengths ~ 0.05 x tulu-helpsteer: prompts ~33, responses ~5 tokens, 6 examples in steps of 3
    return synthetic_workload("tulu-helpsteer", 6, 3, vocab_size=96, seed=1, length_scale=0.05)


def test_groups_are_fixed_and_cover_every_example():
    assert fixed_groups(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError):
        fixed_groups(3, 0)


def test_bucket_length_has_few_values():
    assert [bucket_length(n) for n in (1, 128, 129, 300, 400, 600, 900, 1100, 2000)] == [
        128, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert len({bucket_length(n) for n in range(1, 4097)}) == 10  # 128 .. 4096


def test_layouts_hold_the_same_targets_and_respect_the_pack_length(workload):
    L = common_pack_length(workload.examples)
    group = [workload.examples[i] for i in workload.groups[0]]
    batches = {m: layout_group(group, m, pack_length=L) for m in MODES}
    # every mode predicts exactly the same response tokens, grouped into the same responses and pairs
    for m, b in batches.items():
        assert torch.equal(b.target_ids.sort().values, batches["shared"].target_ids.sort().values), m
        assert torch.equal(b.response_lengths, batches["shared"].response_lengths), m
        assert torch.equal(b.pair_better, batches["shared"].pair_better), m
    for m in ("paired-packed", "shared-packed"):
        assert batches[m].input_ids.shape[1] == L
    # standard modes run the prompt once per response, shared modes once
    standard_tokens = sum(ex.unshared_length for ex in group)
    shared_tokens = sum(ex.shared_length for ex in group)
    assert batches["paired"].num_real_tokens == batches["paired-packed"].num_real_tokens == standard_tokens
    assert batches["shared"].num_real_tokens == batches["shared-packed"].num_real_tokens == shared_tokens
    # paired-packed: each [prompt][response] sequence is its own document (2 per example here)
    from prefixdpo.core.attention.draw import tree_roots

    docs = sum(int(tree_roots(line.numpy()).max()) + 1 for line in batches["paired-packed"].spans)
    assert docs == 2 * len(group)
    assert batches["paired"].input_ids.shape[0] == 2 * len(group)
    assert batches["shared"].input_ids.shape[0] == len(group)


class _FloatDtypes(TorchFunctionMode):
    """Records the dtype of every floating-point tensor a torch function returns."""

    def __init__(self):
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.seen.add(t.dtype)
        return out


def pair_loss_scale(stock: dict, beta: float = BETA) -> float:
    """The rounding scale of a sigmoid DPO loss: beta (its largest slope in the margin) x a pair's four sums
    (policy and reference, both sides; `stock` maps "policy"/"reference" to sums [R])."""
    return beta * 2 * sum(stock[side].abs().max().item() for side in ("policy", "reference"))


def _policy_and_reference(arch: str, dtype: torch.dtype):
    policy = tiny_model(arch).to(dtype)
    reference = tiny_model(arch).to(dtype)
    with torch.no_grad():  # a reference that differs from the policy, so the losses are not all log(2)
        for p in reference.parameters():
            p.mul_(0.9)
    return policy, reference


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fp64_runs_end_to_end_only_where_no_module_downcasts(arch):
    """Why the fp64 equal-work check runs on GPT-2: transformers' Llama RMSNorm computes in fp32 and casts
    back, and its RoPE builds cos/sin in fp32, so a "float64" Llama is fp32-rounded at every layer (1e-9
    cannot be promised there); GPT-2 (LayerNorm, learned positions) stays fp64 in every op."""
    model, _ = _policy_and_reference(arch, torch.float64)
    ids = torch.randint(3, 96, (1, 12))
    with torch.no_grad(), _FloatDtypes() as mode:
        model(input_ids=ids, use_cache=False)
    assert (mode.seen == {torch.float64}) == (arch == "gpt2"), mode.seen


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("gpt2", torch.float64)],
                         ids=["llama-fp32", "gpt2-fp64"])
@pytest.mark.parametrize("backend,line_per_step", [("sdpa", False), ("segmented", True)],
                         ids=["dense-binpacked", "segmented-one-line"])
def test_every_mode_matches_stock_separate_passes(workload, arch, dtype, backend, line_per_step):
    """Equal work, checked against the truth: for every mode (paired, paired-packed, shared,
    shared-packed), with bin-packed lines (dense mask) and one line per step (segmented attention), the
    per-response log-prob sums of policy and reference and the per-pair sigmoid DPO losses equal those of
    STOCK separate passes (the model's own attention, one [prompt][response] at a time), within K_FORWARD eps of
    the sums' largest |value| (losses: beta x a pair's four sums, `pair_loss_scale`), in fp32 and in true fp64
    (see the test above)."""
    policy, reference = _policy_and_reference(arch, dtype)
    L = None if line_per_step else common_pack_length(workload.examples)
    for group in workload.groups:
        examples = [workload.examples[i] for i in group]
        with torch.no_grad():
            stock = {"policy": separate_pass_logps(policy, examples),
                     "reference": separate_pass_logps(reference, examples)}
        prepare_model(policy, backend)
        prepare_model(reference, backend)
        first = layout_group(examples, "paired", pack_length=L)
        better, worse = first.pair_better, first.pair_worse
        stock_loss = sigmoid_loss(stock["policy"][better] - stock["reference"][better],
                                  stock["policy"][worse] - stock["reference"][worse], BETA)
        assert (stock_loss - 0.6931).abs().max() > 1e-3  # the losses compared are not all log(2)
        for mode in MODES:
            batch = layout_group(examples, mode, pack_length=L)
            if line_per_step and mode.endswith("packed"):
                assert batch.input_ids.shape[0] == 1
            assert torch.equal(batch.pair_better, better) and torch.equal(batch.pair_worse, worse)
            mask = plan_pass(batch, backend)
            with torch.no_grad():
                ref = compute_response_logps(reference, batch, mask).sums
            pol = compute_response_logps(policy, batch, mask).sums  # with grad, as in training
            loss = sigmoid_loss(pol[better] - ref[better], pol[worse] - ref[worse], BETA)
            assert pol.dtype == ref.dtype == loss.dtype == dtype
            sums = max(stock["policy"].abs().max().item(), stock["reference"].abs().max().item())
            for name, ours, truth, scale in (("policy logps", pol, stock["policy"], sums),
                                             ("reference logps", ref, stock["reference"], sums),
                                             ("losses", loss, stock_loss, pair_loss_scale(stock))):
                assert_within(ours.detach(), truth, scale, dtype, K_FORWARD, f"mode {mode}, {name}")


def test_step_updates_the_policy_only(workload):
    policy, reference = tiny_model("llama"), tiny_model("llama")
    reference.requires_grad_(False)
    prepare_model(policy, "sdpa")
    prepare_model(reference, "sdpa")
    before_p = [p.detach().clone() for p in policy.parameters()]
    before_r = [p.detach().clone() for p in reference.parameters()]
    batch = layout_group(workload.examples[:3], "shared-packed", pack_length=common_pack_length(workload.examples))
    loss = DPOStep(policy, reference, backend="sdpa", lr=1e-3).step(batch)
    assert loss == pytest.approx(0.6931, abs=1e-3)  # policy == reference: every margin is 0
    assert any(not torch.equal(a, b) for a, b in zip(before_p, policy.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before_r, reference.parameters()))


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_tiny_bench_cli_run_writes_tables_json_and_chart(tmp_path, clock):
    from prefixdpo.cli import main

    out = tmp_path / "res"
    rc = main(["bench", "--quick", "--profiles", "hh-rlhf", "--examples", "4", "--per-step", "2",
               "--repeats", "2", "--warmup", "0", "--length-scale", "0.1", "--threads", "1",
               "--out", str(out), "--no-progress", "--clock", clock])
    assert rc == 0
    md = (out / "bench.md").read_text()
    assert "| hh-rlhf | shared-packed |" in md and "paper packed" in md
    assert f"steps timed by {clock} clock" in md
    data = json.loads((out / "bench.json").read_text())
    assert [p["name"] for p in data["profiles"]] == ["hh-rlhf"]
    for prof in data["profiles"]:
        assert set(prof["modes"]) == set(MODES)
        assert prof["ideal"] > 1.0
        for mode in prof["modes"].values():
            assert mode["pairs_per_s"]["min"] <= mode["pairs_per_s"]["median"] <= mode["pairs_per_s"]["max"]
            assert mode["pairs_per_s"]["min"] > 0 and len(mode["seconds"]) == 2
        assert prof["achieved_over_ideal"] == pytest.approx(
            prof["speedups"]["shared_packed_vs_paired_packed"]["median"] / prof["ideal"])
        # shared modes run fewer tokens than standard ones on the same examples
        assert prof["modes"]["shared"]["tokens"] < prof["modes"]["paired"]["tokens"]
        for packed in ("paired-packed", "shared-packed"):  # one line per step, padded to 8 (segmented), not 128
            mode = prof["modes"][packed]
            assert mode["lines"] == mode["steps"] and mode["slots"] - mode["tokens"] < 8 * mode["lines"]
        roof = prof["roofline"]  # each mode's useful FLOP/s beside the matmul rate read after each pass
        assert roof["matmul"].startswith("2048^3 float32, 1 threads") and roof["matmul_gflops"]["min"] > 0
        assert set(roof["share"]) == set(MODES) and all(s["min"] > 0 for s in roof["share"].values())
        # paired modes must compute each pair's two sequences; shared ones each prompt once, whatever the packing
        assert roof["useful_gflop"]["paired"] == roof["useful_gflop"]["paired-packed"]
        assert roof["useful_gflop"]["shared"] == roof["useful_gflop"]["shared-packed"] < roof["useful_gflop"]["paired"]
    assert "## Roofline" in md
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_roofline_shares_are_per_pass_ratios_of_useful_flops_over_the_matmul_rate():
    import torch

    from prefixdpo_tools.bench.roofline import Roofline, RooflineProbe

    # 25 GFLOP forward -> a DPO step's useful 100 GFLOP (policy 3 + reference 1); passes of 2 s and 4 s, with the
    # matmul at 100 then 50 GFLOP/s: 50 and 25 GFLOP/s useful, half the roofline in both passes
    roof = Roofline.of(RooflineProbe(torch.float32), torch.device("cpu"), [100.0, 50.0],
                       {"paired": [2.0, 4.0], "shared": [1.0, 1.0]}, {"standard": 25e9, "per_record": 10e9})
    assert roof.useful_gflop == {"paired": 100.0, "shared": 40.0}
    assert (roof.useful_gflops["paired"].min, roof.useful_gflops["paired"].max) == (25.0, 50.0)
    assert (roof.share["paired"].min, roof.share["paired"].max) == (0.5, 0.5)
    assert (roof.share["shared"].min, roof.share["shared"].max) == (0.4, 0.8)
    reward = Roofline.of(RooflineProbe(torch.float32, forwards_per_step=3), torch.device("cpu"), [100.0],
                         {"shared": [1.0]}, {"per_record": 10e9})
    assert reward.useful_gflop == {"shared": 30.0}


class _SleepingStep:
    """A stepper that computes nothing and waits: the time of other jobs on a shared machine, as a clock sees it."""

    def step(self, batch):
        time.sleep(0.05)


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_the_cpu_clock_leaves_out_time_the_step_does_not_compute(clock):
    from prefixdpo_tools.bench.clock import step_clock
    from prefixdpo_tools.bench.flops import ModelShape
    from prefixdpo_tools.bench.runner import run_workload

    workload = synthetic_workload("hh-rlhf", 2, 1, vocab_size=64, seed=0, length_scale=0.05)
    result = run_workload(workload, _SleepingStep(), ModelShape(64, 128, 1, 2, 1, 32, 64), repeats=1, warmup=0,
                          modes=("paired", "shared"), clock=step_clock(clock, "cpu"))
    seconds = result.modes["paired"].seconds[0]  # two steps of 0.05 s asleep
    assert (seconds >= 0.1) if clock == "wall" else (seconds < 0.02)


def test_the_cpu_clock_is_refused_for_a_cuda_bench():
    from prefixdpo_tools.bench.clock import step_clock

    with pytest.raises(ConfigError, match="--clock cpu times CPU steps only"):
        step_clock("cpu", "cuda")


def test_bench_cli_rejects_an_unknown_profile(tmp_path, capsys):
    from prefixdpo.cli import main

    assert main(["bench", "--profiles", "nope", "--out", str(tmp_path), "--no-progress", "--quick"]) == 2
    assert "unknown profile 'nope'" in capsys.readouterr().err


def test_bench_on_a_real_dataset_and_model_by_path(tmp_path):
    """--dataset/--tokenizer/--model: records go through the real data pipeline, the model loads by path."""
    from prefixdpo.cli import main
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    records = [{"prompt": f"Question {i}: what comes after {i}? Think about it carefully.",
                "chosen": f" {i + 1}.", "rejected": f" {i - 1}, I believe."} for i in range(8)]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = build_tiny_tokenizer([r[k] for r in records for k in ("prompt", "chosen", "rejected")])
    model_dir = tmp_path / "model"
    tokenizer.save_pretrained(model_dir)
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    out = tmp_path / "res"
    rc = main(["bench", "--dataset", str(data), "--model", str(model_dir), "--examples", "4", "--per-step", "2",
               "--repeats", "1", "--warmup", "0", "--threads", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    prof = json.loads((out / "bench.json").read_text())["profiles"][0]
    assert prof["examples"] == 4 and set(prof["modes"]) == set(MODES)
    assert prof["modes"]["shared"]["tokens"] < prof["modes"]["paired"]["tokens"]


def test_multi_response_profile_standard_runs_two_sequences_per_pair_and_matches_stock():
    """ultrafeedback-k4: 4 responses, best vs each (3 pairs). The standard modes run 3 pairs = 6
    [prompt][response] sequences per example (the best 3 times), the shared modes 1 row with the 4
    responses once; every mode's per-pair DPO losses equal stock separate passes (fp32, within K_FORWARD eps of
    `pair_loss_scale`)."""
    from prefixdpo_tools.bench.modes import standard_examples
    from prefixdpo_tools.bench.flops import ModelShape, ideal_speedup, shared_flop_count, standard_flop_count

    w = synthetic_workload("ultrafeedback-k4", 4, 2, vocab_size=96, seed=2, length_scale=0.03)
    assert w.num_pairs == 12
    policy, reference = _policy_and_reference("llama", torch.float32)
    for group in w.groups:
        examples = [w.examples[i] for i in group]
        with torch.no_grad():
            stock_pol = separate_pass_logps(policy, examples)  # [4 per example]
            stock_ref = separate_pass_logps(reference, examples)
        better = torch.tensor([4 * e + i for e, ex in enumerate(examples) for i, _ in ex.pairs])
        worse = torch.tensor([4 * e + j for e, ex in enumerate(examples) for _, j in ex.pairs])
        stock_loss = sigmoid_loss(stock_pol[better] - stock_ref[better], stock_pol[worse] - stock_ref[worse], BETA)
        L = common_pack_length(examples)
        for mode in MODES:
            batch = layout_group(examples, mode, pack_length=L)
            n_seq = int(batch.pair_better.numel() * 2) if mode.startswith("paired") else 4 * len(examples)
            assert batch.num_real_tokens == (
                sum(len(s.prompt_ids) + len(r) for ex in examples for s in standard_examples(ex) for r in s.response_ids)
                if mode.startswith("paired") else sum(ex.shared_length for ex in examples))
            if mode == "paired":
                assert batch.input_ids.shape[0] == n_seq == 6 * len(examples)
            if mode == "shared":
                assert batch.input_ids.shape[0] == len(examples)
            prepare_model(policy, "sdpa")
            prepare_model(reference, "sdpa")
            mask = plan_pass(batch, "sdpa")
            with torch.no_grad():
                pol = compute_response_logps(policy, batch, mask).sums
                ref = compute_response_logps(reference, batch, mask).sums
            b, wr = batch.pair_better, batch.pair_worse
            loss = sigmoid_loss(pol[b] - ref[b], pol[wr] - ref[wr], BETA)
            scale = pair_loss_scale({"policy": stock_pol, "reference": stock_ref})
            assert_within(loss, stock_loss, scale, k=K_FORWARD, what=f"mode {mode} losses")

    # The FLOP model's standard side counts 2 sequences per pair: by hand for prompt 3, responses 2, 1, 1, 1.
    tiny = ModelShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10)
    from prefixdpo.data.example import Example
    ex = Example((5, 6, 7), ((8, 9), (4,), (5,), (6,)), ((0, 1), (0, 2), (0, 3)))
    # 6 sequences: 3 x [ppp aa] (5 tokens, 15 attention pairs, 2 head positions) + 3 x [ppp b] (4, 10, 1).
    assert standard_flop_count(tiny, ex).body == 2 * 288 * (3 * 5 + 3 * 4)
    assert standard_flop_count(tiny, ex).attention == 2 * 4 * 2 * 2 * (3 * 15 + 3 * 10)
    assert standard_flop_count(tiny, ex).lm_head == 2 * 4 * 10 * (3 * 2 + 3 * 1)
    # shared row [ppp aa b c d]: 8 tokens; 6 + (2*3+3) + 3 x (3+1) = 27 attention pairs; 5 head positions.
    assert shared_flop_count(tiny, ex).body == 2 * 288 * 8
    assert shared_flop_count(tiny, ex).attention == 2 * 4 * 2 * 2 * 27
    assert ideal_speedup(tiny, w.examples) > ideal_speedup(tiny, [standard_examples(e)[0] for e in w.examples])


def test_the_bench_model_can_be_a_hybrid_of_its_size():
    """`bench --architecture` builds each listed hybrid at the bench shape (its layer pattern tiled to the shape's
    layers): the FLOP model then counts the pair term on its attention layers only."""
    from prefixdpo.commands.bench import BENCH_ARCHITECTURES
    from prefixdpo_tools.bench.flops import ModelShape
    from prefixdpo_tools.bench.model import DEFAULT_SHAPE, QUICK_SHAPE
    from prefixdpo_tools.bench.pair_report import architecture_model
    from prefixdpo_tools.hybrid_models import HYBRID_FAMILIES

    assert set(BENCH_ARCHITECTURES) <= set(HYBRID_FAMILIES)
    assert architecture_model(QUICK_SHAPE, "llama") is QUICK_SHAPE
    for shape in (QUICK_SHAPE, DEFAULT_SHAPE):
        for family in BENCH_ARCHITECTURES:
            config = architecture_model(shape, family)
            counted = ModelShape.from_config(config)
            assert (counted.hidden, counted.layers, counted.vocab) == (shape.hidden, shape.layers, shape.vocab)
            assert 0 < counted.pair_layers < shape.layers and counted.recurrent_flops_per_token > 0, family
