"""Shared-prefix bench profiles (`shp-like`: several pair records per post; `system-prompt`: one system prompt in
front of every record; `multi-turn`: a pair at each turn of a dialogue), the grouped-packed (`--group_by_prompt`)
and trie-packed (a token trie across records) modes, and their FLOP ideals.

Both modes' per-pair losses and log-prob sums equal STOCK separate passes (each `[prompt][response]` alone, the
model's own attention), fp32, within K_FORWARD eps of the sums' largest |value| (losses: of
`test_bench.pair_loss_scale`), on the dense mask with bin-packed lines
and on segmented attention with one line per step. About 35 s on 2 busy CPU cores (two tiny bench runs).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from prefixdpo_tools.bench.flops import (
    ModelShape, forward_flops, shared_flop_count, standard_flop_count, step_ideals, trie_flop_count,
)
from prefixdpo_tools.bench.modes import GROUPED_MODE, TRIE_MODE, common_pack_length, layout_group
from prefixdpo_tools.bench.runner import workload_modes
from prefixdpo_tools.bench.workloads import shared_prefix_workload
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.core.verify import separate_pass_logps
from prefixdpo.data.example import Example
from prefixdpo.data.grouping import PAIR_RECORDS, group_by_prompt
from prefixdpo.data.synthetic import SHARED_PREFIX_PROFILES, shared_prefix_examples
from prefixdpo.dpo.losses import sigmoid_loss
from test_bench import pair_loss_scale
from tolerances import K_FORWARD, assert_within

TINY = ModelShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10)


def test_shared_prefix_profiles_shp_like_system_prompt_and_multi_turn():
    records = shared_prefix_examples("shp-like", 6, vocab_size=1000, seed=3)
    assert records == shared_prefix_examples("shp-like", 6, vocab_size=1000, seed=3)  # deterministic
    posts = {}
    for ex in records:
        posts.setdefault(ex.meta["prompt"], []).append(ex)
    assert sorted(posts) == list(range(6))
    for post in posts.values():
        assert 150 <= len(post[0].prompt_ids) <= 400 and all(ex.prompt_ids == post[0].prompt_ids for ex in post)
        comments = {r for ex in post for r in ex.response_ids}
        assert 4 <= len(comments) <= 7 and min(10, len(comments) * (len(comments) - 1) // 2) >= len(post) >= 5
        assert len({frozenset(ex.response_ids) for ex in post}) == len(post)  # each two comments at most once
    assert [ex.source_index for ex in records] == list(range(len(records)))

    system = SHARED_PREFIX_PROFILES["system-prompt"]
    records = shared_prefix_examples("system-prompt", 5, vocab_size=1000)
    assert len(records) == 5 and len({ex.prompt_ids for ex in records}) == 5
    assert len({ex.prompt_ids[:system.system_length] for ex in records}) == 1
    assert len({ex.prompt_ids[:system.system_length + 1] for ex in records}) == 5

    records = shared_prefix_examples("multi-turn", 4, vocab_size=1000, seed=1)
    dialogues = {}
    for ex in records:
        dialogues.setdefault(ex.meta["prompt"], []).append(ex)
    for turns in dialogues.values():
        assert 3 <= len(turns) <= 5 and [ex.meta["turn"] for ex in turns] == list(range(len(turns)))
        for before, after in zip(turns, turns[1:]):  # the next prompt: this one, its preferred response, a message
            seen = before.prompt_ids + before.response_ids[0]
            assert after.prompt_ids[:len(seen)] == seen and 30 <= len(after.prompt_ids) - len(seen) <= 150


def test_step_ideals_count_grouping_and_the_trie_by_hand():
    """Records (prompt [1 2 3 4], responses a = 2, b = 1, c = 1 tokens): ab, ac, cb; and [1 2 7] with ab."""
    a, b, c = (5, 5), (6,), (7,)
    step = [Example((1, 2, 3, 4), rs, ((0, 1),), i) for i, rs in enumerate(((a, b), (a, c), (c, b)))]
    step.append(Example((1, 2, 7), (a, b), ((0, 1),), 3))
    standard = sum(standard_flop_count(TINY, ex).total for ex in step)
    per_record = sum(shared_flop_count(TINY, ex).total for ex in step)
    # grouped: [1 2 3 4][a][b][c] = 8 tokens, 10 + (2*4+3) + (4+1) + (4+1) = 31 pairs, 4 head positions; [1 2 7][a][b]
    grouped = forward_flops(TINY, 8, 31, 4).total + shared_flop_count(TINY, step[3]).total
    # trie: [1 2] once (3 pairs); [3 4] over it (2*2 + 3 pairs) then a, b, c; [7] (2 + 1) then a, b over [1 2 7]
    trie = (forward_flops(TINY, 2, 3, 0) + forward_flops(TINY, 2 + 4, 4 + 3 + 11 + 5 + 5, 4)
            + forward_flops(TINY, 1 + 3, 2 + 1 + (2 * 3 + 3) + (3 + 1), 3)).total
    assert trie_flop_count(TINY, step).total == trie
    ideals = step_ideals(TINY, [step])
    assert ideals == pytest.approx({"per_record": standard / per_record, "grouped": standard / grouped,
                                    "trie": standard / trie})
    assert ideals["trie"] > ideals["grouped"] > ideals["per_record"] > 1
    # nothing shared across records: all three ideals are per-record sharing's
    alone = step_ideals(TINY, [[step[0]], [step[3]]])
    assert alone["per_record"] == alone["grouped"] == alone["trie"]


@pytest.mark.parametrize("backend,line_per_step", [("sdpa", False), ("segmented", True)],
                         ids=["dense-binpacked", "segmented-one-line"])
@pytest.mark.parametrize("profile,mode", [("shp-like", GROUPED_MODE), ("multi-turn", TRIE_MODE),
                                          ("system-prompt", TRIE_MODE)])
def test_grouped_and_trie_modes_match_stock_separate_passes(profile, mode, backend, line_per_step):
    """Each step's records (shp-like: a post's pair records; multi-turn: a dialogue; system-prompt: records behind
    one system prompt) in the mode's layout: every pair's log-prob sums and sigmoid loss equal stock passes."""
    per_step = 4 if profile == "system-prompt" else 1
    workload = shared_prefix_workload(profile, 2 * per_step, per_step, vocab_size=96, seed=1, length_scale=0.05)
    policy, reference = tiny_model("llama"), tiny_model("llama")
    with torch.no_grad():  # a reference that differs from the policy, so the losses are not all log(2)
        for p in reference.parameters():
            p.mul_(0.9)
    steps = [[workload.examples[i] for i in group] for group in workload.groups]
    assert len(steps) == 2 and all(len(step) >= 3 for step in steps)
    assert workload_modes(workload, trie=True)[4:] == (mode,)
    grouped_all = [g for step in steps for g in group_by_prompt(step)[0]]
    L = None if line_per_step else common_pack_length(workload.examples, grouped=grouped_all)
    for step in steps:
        with torch.no_grad():
            stock_pol, stock_ref = separate_pass_logps(policy, step), separate_pass_logps(reference, step)
        prepare_model(policy, backend)
        prepare_model(reference, backend)
        batch = layout_group(step, mode, pack_length=L)
        assert batch.num_real_tokens < sum(ex.shared_length for ex in step)
        mask = plan_pass(batch, backend)
        with torch.no_grad():
            ref = compute_response_logps(reference, batch, mask).sums
        pol = compute_response_logps(policy, batch, mask).sums
        # the batch's pairs, by record: the stock sums of record r are rows 2r (better) and 2r + 1 (worse); grouped
        # rows hold their pairs prompt by prompt, tree lines record by record
        first = step[0].source_index
        if mode == GROUPED_MODE:
            records = torch.tensor([r for g in group_by_prompt(step)[0] for r in g.meta[PAIR_RECORDS]]) - first
        else:
            records = torch.arange(len(step))
        b, w = batch.pair_better, batch.pair_worse
        sums = max(stock_pol.abs().max().item(), stock_ref.abs().max().item())
        for name, ours, truth in (("policy", pol, stock_pol), ("reference", ref, stock_ref)):
            assert_within(ours[b].detach(), truth[2 * records], sums, k=K_FORWARD, what=f"{name} better")
            assert_within(ours[w].detach(), truth[2 * records + 1], sums, k=K_FORWARD, what=f"{name} worse")
        loss = sigmoid_loss(pol[b] - ref[b], pol[w] - ref[w], 0.1)
        stock = sigmoid_loss(stock_pol[2 * records] - stock_ref[2 * records],
                             stock_pol[2 * records + 1] - stock_ref[2 * records + 1], 0.1)
        assert (stock - 0.6931).abs().max() > 1e-3
        scale = pair_loss_scale({"policy": stock_pol, "reference": stock_ref}, beta=0.1)
        assert_within(loss.detach(), stock, scale, k=K_FORWARD, what="losses")


@pytest.mark.parametrize("task", ["dpo", "reward"])
def test_bench_runs_the_shared_prefix_profiles_with_their_ideals(tmp_path, task):
    from prefixdpo.cli import main

    out = tmp_path / "res"
    assert main(["bench", "--quick", "--task", task, "--profiles", "shp-like,system-prompt,multi-turn",
                 "--examples", "4", "--per-step", "2", "--repeats", "1", "--warmup", "0", "--length-scale", "0.08",
                 "--threads", "1", "--out", str(out), "--no-progress"]) == 0
    data = {p["name"]: p for p in json.loads((out / "bench.json").read_text())["profiles"]}
    shp, system = data["shp-like"], data["system-prompt"]
    assert GROUPED_MODE in shp["modes"] and GROUPED_MODE not in system["modes"]
    # a token trie runs for either task's step where it shares more than grouping
    assert [TRIE_MODE in data[name]["modes"] for name in ("shp-like", "system-prompt", "multi-turn")] == [
        False, True, True]
    assert system["modes"][TRIE_MODE]["tokens"] < system["modes"]["shared-packed"]["tokens"]
    assert system["trie_over_ideal"]["vs_paired_packed"] == pytest.approx(
        system["speedups"]["trie_packed_vs_paired_packed"]["median"] / system["ideals"]["trie"])
    assert shp["modes"][GROUPED_MODE]["tokens"] < shp["modes"]["shared-packed"]["tokens"]
    assert shp["ideals"]["grouped"] > shp["ideals"]["per_record"] == pytest.approx(shp["ideal"])
    assert shp["grouped_over_ideal"]["vs_paired_packed"] == pytest.approx(
        shp["speedups"]["grouped_packed_vs_paired_packed"]["median"] / shp["ideals"]["grouped"])
    for other in (system, data["multi-turn"]):  # no prompt repeats: only a trie shares more
        assert other["ideals"]["grouped"] == other["ideals"]["per_record"] < other["ideals"]["trie"]
    md = (out / "bench.md").read_text()
    assert "## Records that share prompts or prefixes" in md
