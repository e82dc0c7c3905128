"""`prefixdpo bench --task grpo`: rollouts shaped as TRL's, the FLOP model, the three modes on the same rollouts, and a
tiny end-to-end run of the command. About 25 s on 2 cores."""

from __future__ import annotations

import json

import pytest
import torch

from prefixdpo.cli import main
from prefixdpo_tools.bench.grpo import (
    MODES,
    PROFILES,
    GroupTrainingStep,
    build_bench_trainer,
    ideal_speedups,
    run_profile,
    synthetic_rollouts,
    trl_rows_flops,
    useful_flops,
)
from prefixdpo_tools.bench.model import SHAPES, llama_config
from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
from prefixdpo_tools.bench.flops import forward_flops
from prefixdpo.core.models import load_causal_lm
from tolerances import K_FORWARD, assert_within

SHAPE = SHAPES["quick"]
TINY = PROFILES["math-like"].scaled(0.05)  # prompts 8-15 tokens (system 6), completions 15-40


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)  # tiny models; conftest restores the thread count


def test_rollouts_are_trl_rows_of_whole_groups():
    (rollout,) = synthetic_rollouts(TINY, 1, vocab_size=SHAPE.vocab, seed=3)
    G, B = TINY.group_size, TINY.prompts_per_step
    K = rollout.logits_to_keep
    assert rollout.num_rows == G * B and K == TINY.completion_tokens[1]
    assert (rollout.prompt_mask[:, 0] == 0).any() and (rollout.prompt_mask[:, -1] == 1).all()  # left-padded
    lengths = rollout.completion_mask.sum(1)
    ends = rollout.completion_ids[torch.arange(rollout.num_rows), lengths - 1] == 2
    assert ends.any() and (~ends).any() and (lengths[~ends] == K).all()  # EOS, or cut at the maximum length
    assert torch.equal(rollout.completion_mask, (torch.arange(K) < lengths[:, None]).long())
    prompts = {tuple(p[m.bool()].tolist()) for p, m in zip(rollout.prompt_ids, rollout.prompt_mask)}
    assert len(prompts) == B and [len(cs) for _, cs in rollout.groups] == [G] * B
    system = TINY.system_tokens
    assert len({p[:system] for p in prompts}) == 1  # one system prompt for all
    assert sorted(lengths.tolist()) == sorted(c for _, cs in rollout.groups for c in cs)
    again = synthetic_rollouts(TINY, 1, vocab_size=SHAPE.vocab, seed=3)[0]
    assert torch.equal(again.completion_ids, rollout.completion_ids)  # seeded


def test_flop_model():
    rollouts = synthetic_rollouts(TINY, 2, vocab_size=SHAPE.vocab)
    r = rollouts[0]
    N, L = r.num_rows, r.prompt_ids.shape[1] + r.logits_to_keep
    assert trl_rows_flops(SHAPE, r, head_every_position=True) == forward_flops(SHAPE, N * L, N * L * L, N * (L - 1))
    assert trl_rows_flops(SHAPE, r, head_every_position=False).lm_head == 2 * SHAPE.hidden * SHAPE.vocab * int(
        r.completion_mask.sum())
    # sharing: the prompt's body FLOPs once per group instead of G times, completion tokens the same
    saved = sum((len(cs) - 1) * p for p, cs in r.groups)
    diff = useful_flops(SHAPE, r, shared=False).body - useful_flops(SHAPE, r, shared=True).body
    assert diff == 2 * SHAPE.body_params_per_token() * saved
    ideal = ideal_speedups(SHAPE, rollouts, head_every_position=True)
    assert ideal.vs_trl_rows > ideal.sharing_alone > 1.0
    assert sum(ideal.split_trl.values()) == pytest.approx(1.0)


def test_whole_step_flop_model():
    from prefixdpo_tools.bench.grpo_step import decode_cascade_ideal, generation_flops, reward_rows, scoring_flops

    N, P, K = 16, 40, 30
    for shared in (True, False):
        _, decode = generation_flops(SHAPE, N, 2, P, K, shared=shared)
        assert decode == generation_flops(SHAPE, N, 2, P, K, shared=not shared)[1]  # decoding: the same work
    trl_prefill = generation_flops(SHAPE, N, 2, P, K, shared=False)[0]
    # every row unique: the same slots through the body (P - 1 columns, then the last one inside generate)
    assert generation_flops(SHAPE, N, N, P, K, shared=True)[0].body == trl_prefill.body
    shared_prefill = generation_flops(SHAPE, N, 2, P, K, shared=True)[0]
    assert shared_prefill.body == 2 * SHAPE.body_params_per_token() * (2 * (P - 1) + N)
    assert trl_prefill.total / shared_prefill.total > 5
    assert decode_cascade_ideal(SHAPE, N, N, P, K, 4) == pytest.approx(1.0)
    assert decode_cascade_ideal(SHAPE, N, 2, 4 * P, K, 4) > decode_cascade_ideal(SHAPE, N, 2, P, K, 4) > 1.0
    (rollout,) = synthetic_rollouts(TINY, 1, vocab_size=SHAPE.vocab, seed=1)
    ids, mask, groups = reward_rows(rollout, pad_id=0)
    for i in range(rollout.num_rows):  # each row: its real prompt tokens, then its real completion tokens
        want = torch.cat([rollout.prompt_ids[i][rollout.prompt_mask[i].bool()],
                          rollout.completion_ids[i][rollout.completion_mask[i].bool()]])
        assert torch.equal(ids[i][mask[i].bool()], want) and mask[i, :len(want)].all()
    assert sorted(groups.count(g) for g in set(groups)) == [TINY.group_size] * TINY.prompts_per_step
    trl, shared = (scoring_flops(SHAPE, ids, mask, groups, shared=s) for s in (False, True))
    assert trl.lm_head == shared.lm_head == 0 and trl.total > shared.total
    # each prompt once per group, the system prompt once for all (completions sharing first tokens: fewer still)
    assert 0 < shared.body <= 2 * SHAPE.body_params_per_token() * (
        int(mask.sum()) - sum((len(cs) - 1) * p for p, cs in rollout.groups)
        - (TINY.prompts_per_step - 1) * TINY.system_tokens)


def test_modes_run_the_same_rollouts_and_agree(tmp_path):
    """lr 0: every mode runs on the same weights, so each pass of a step (old policy, reference, the policy twice)
    must return the same per-token log-probs in every mode, and TRL's logged entropy must agree."""
    torch.manual_seed(0)
    model = load_causal_lm(llama_config(SHAPE), dtype=torch.float32)
    with torch.no_grad():  # a model whose log-probs depend on the input (default init: nearly uniform)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "model")
    trainer = build_bench_trainer(str(tmp_path / "model"), build_tiny_tokenizer(), backend="segmented",
                                  dtype=torch.float32, device="cpu", beta=0.04, num_iterations=2, group_size=2,
                                  output_dir=str(tmp_path / "out"))
    assert trainer.ref_model is not None
    passes = []
    run_pass = trainer._get_per_token_logps_and_entropies

    def recording(*args, **kwargs):
        out = run_pass(*args, **kwargs)
        passes.append(out[0].detach().clone())
        return out

    trainer._get_per_token_logps_and_entropies = recording
    step = GroupTrainingStep(trainer, lr=0.0, line_per_step=True)
    rollouts = synthetic_rollouts(TINY, 2, vocab_size=SHAPE.vocab)
    result = run_profile(TINY, rollouts, step, SHAPE, device="cpu", repeats=1, warmup=0)
    # per rollout and mode: old policy, reference, policy, policy (num_iterations 2)
    assert len(passes) == 2 * len(MODES) * 4
    for r in range(2):
        by_mode = [passes[(r * len(MODES) + m) * 4:(r * len(MODES) + m + 1) * 4] for m in range(len(MODES))]
        for trl_pass, shared_pass, packed_pass in zip(*by_mode):
            scored = rollouts[r].completion_mask.bool()
            assert trl_pass[scored].std() > 0.5  # log-probs that tell tokens apart
            scale = trl_pass.abs().max().item()  # per-token log-probs: their largest |value| is their rounding's scale
            assert_within(shared_pass, trl_pass, scale, k=K_FORWARD, what="shared pass")
            assert_within(packed_pass, trl_pass, scale, k=K_FORWARD, what="packed pass")
    trl, shared, packed = (result.modes[m] for m in MODES)
    for mode in (shared, packed):
        assert len(mode.entropies) == 2
        for a, b in zip(trl.entropies, mode.entropies):
            assert a > 0.5
            assert_within(b, a, a, k=K_FORWARD, what="mean entropy")  # a mean of positive terms: its own scale
    # the same completion tokens, each prompt once instead of G times
    assert shared.tokens == packed.tokens
    assert trl.tokens - shared.tokens == sum((len(cs) - 1) * p for r in rollouts for p, cs in r.groups)
    assert packed.lines == 2 and shared.lines == 2 * TINY.prompts_per_step and trl.lines == 2 * 16
    assert packed.fill == 1.0 and trl.fill < 1.0
    assert all(s > 0 for m in MODES for s in result.modes[m].seconds)
    assert trainer.args.prefix_sharing and trainer.args.pack_length == "auto"  # the modes' settings restored


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_bench_grpo_command_end_to_end(tmp_path, capsys, clock):
    out = tmp_path / "bench"
    argv = ["bench", "--task", "grpo", "--quick", "--length-scale", "0.05", "--rollouts", "1", "--repeats", "1",
            "--warmup", "0", "--threads", "1", "--no-progress", "--out", str(out), "--clock", clock]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "--quick: scaled down" in printed and "## Whole step: generation + reward-model scoring" in printed
    assert f"timed by {clock} clock" in printed
    data = json.loads((out / "bench.json").read_text())
    assert (out / "bench.md").read_text() in printed
    assert [p["name"] for p in data["profiles"]] == list(PROFILES)
    for p in data["profiles"]:
        assert p["ideal"]["vs_trl_rows"] > p["ideal"]["sharing_alone"] > 1.0 and p["achieved_over_ideal"] > 0
        assert all(s["median"] > 0 for s in p["speedups"].values())
        modes = p["modes"]
        assert modes["trl"]["tokens"] > modes["shared"]["tokens"] == modes["shared-packed"]["tokens"]
        assert all(modes[m]["completions_per_s"]["median"] > 0 for m in MODES)
    assert [w["profile"] for w in data["whole_steps"]] == list(PROFILES)
    for w in data["whole_steps"]:
        assert all(w["phases"][p][side] > 0 for p in ("generation", "scoring", "training") for side in ("trl", "ours"))
        assert sum(w["shares"]["trl"].values()) == pytest.approx(1.0) and w["speedup"] > 0
        # each prompt's G copies prefilled once: the prefill's FLOPs shrink, and so the whole step's ideal
        assert w["ideals"]["prefill"] > 1.5 and w["ideals"]["scoring"] > 1.0 and w["ideals"]["whole_step"] > 1.0
        assert w["unique_prompts"] == PROFILES[w["profile"]].prompts_per_step and w["rows"] == 16
        assert 0.0 <= w["same_tokens"] <= 1.0


@pytest.mark.parametrize("option,message", [
    (["--dataset", "x.jsonl"], "--dataset is for --task dpo / reward"),
    (["--examples", "4"], "--examples is for --task dpo / reward"),
    (["--profiles", "capybara"], "unknown profile(s) capybara for --task grpo"),
    (["--attention", "varlen"], "--attention varlen: attention='varlen' needs a CUDA device"),
    (["--num-iterations", "0"], "--num-iterations >= 1"),
])
def test_bad_options_are_one_line(option, message, capsys):
    assert main(["bench", "--task", "grpo", "--quick", *option]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
