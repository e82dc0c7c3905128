"""Token trees across records (`data.tree`): records whose sequences share leading tokens run them once per line.

Exactness against STOCK separate passes (each `[prompt][response]` alone, the model's own attention): every
response's log-prob sum within K_FORWARD eps x the largest |sum| and every gradient entry of a DPO-shaped loss
within K eps x the largest entry (`tolerances`; float64: tests/test_equivalence.py), fp32, on Llama, Qwen2 (GQA),
Qwen3, Gemma and GPT-2 (learned absolute positions),
for trees of depth 1 (records of one prompt), 2 (a system prompt, then prompts, then responses) and 3 (a
dialogue: each turn's prompt holds the earlier turns), packed two lines with padding, on the dense SDPA mask and on the segment plan cut
along the tree; FlexAttention's mask_mod equals the dense mask element-wise and its forward (CPU, no backward
there) equals SDPA's (varlen's plan: tests/test_varlen.py). About 60 s on 2 busy CPU cores.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_model
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.core.verify import dpo_loss, separate_pass_logps
from prefixdpo.data.example import Example
from prefixdpo.data.tree import build_tree_batch, tree_line
from tolerances import K_FORWARD, assert_within


def _ids(g: random.Random, n: int) -> tuple[int, ...]:
    return tuple(g.randrange(3, 96) for _ in range(n))


def depth_1(g: random.Random) -> list[Example]:
    """Two prompts, each named by three records; one response is in two records, one pair named twice."""
    out = []
    for _ in range(2):
        prompt, rs = _ids(g, g.randrange(5, 9)), [_ids(g, g.randrange(2, 6)) for _ in range(3)]
        out += [Example(prompt, (rs[0], rs[1]), ((0, 1),)), Example(prompt, (rs[2], rs[0]), ((0, 1),)),
                Example(prompt, (rs[0], rs[1]), ((1, 0),))]
    return out


def depth_2(g: random.Random) -> list[Example]:
    """A system prompt in front of four user prompts (one named by two records), K = 2 and 3."""
    system = _ids(g, 6)
    prompts = [system + _ids(g, g.randrange(3, 7)) for _ in range(3)]
    out = [Example(p, tuple(_ids(g, g.randrange(2, 6)) for _ in range(2 + i % 2)), ((0, 1),))
           for i, p in enumerate(prompts)]
    return out + [Example(prompts[0], (_ids(g, 4), out[0].response_ids[1]), ((0, 1),))]


def dialogue(g: random.Random, turns: int) -> list[Example]:
    """A dialogue behind a system prompt, a pair at each turn: turn t's prompt is turn t-1's prompt, its chosen
    response and the next user message (so a chosen response is also part of the later prompts)."""
    prompt, out = _ids(g, 5) + _ids(g, 4), []
    for _ in range(turns):
        chosen, rejected = _ids(g, g.randrange(2, 5)), _ids(g, g.randrange(2, 5))
        out.append(Example(prompt, (chosen, rejected), ((0, 1),)))
        prompt = prompt + chosen + _ids(g, 3)
    return out


def depth_3(g: random.Random) -> list[Example]:
    """A three-turn dialogue (its own line: depth 3) and a two-turn one."""
    return dialogue(g, 3) + dialogue(g, 2)


GEMMA = {"head_dim": 8, "num_key_value_heads": 1}  # its config's default head_dim (256) does not fit hidden 32
# builder, the depth its first line reaches, the lines (example indices; two, the shorter one padded)
CASES = {"depth-1": (depth_1, 1, [[0, 1, 2], [3, 4, 5]]), "depth-2": (depth_2, 2, [[0, 1, 3], [2]]),
         "depth-3": (depth_3, 3, [[0, 1, 2], [3, 4]])}


def test_a_tree_line_lays_shared_tokens_once_at_their_depth():
    """System [1 2], prompts [1 2 3] and [1 2 4]; responses [5 6], [7] after [1 2 3] and [5] after [1 2 4]."""
    examples = [Example((1, 2, 3), ((5, 6), (7,)), ((0, 1),)), Example((1, 2, 4), ((5,), (7,)), ((0, 1),))]
    line = tree_line(examples)
    assert line.input_ids == (1, 2, 3, 5, 6, 7, 4, 5, 7)
    assert line.position_ids == (0, 1, 2, 3, 4, 3, 2, 3, 3)
    assert line.tin == tuple(range(9)) and line.tout == (9, 9, 6, 5, 5, 6, 9, 8, 9)
    assert line.sequences == ((0, 1, 2, 3, 4), (0, 1, 2, 5), (0, 1, 6, 7), (0, 1, 6, 8))
    assert line.depth == 2
    batch = build_tree_batch(examples, pad_multiple=4)
    assert batch.input_ids.shape == (1, 12) and batch.spans[0, :, 0].tolist() == list(range(9)) + [-1] * 3
    assert batch.spans[0, :9, 1].tolist() == list(line.tout) and batch.response_last.tolist() == [4, 5, 7, 8]
    # response 0's tokens 5, 6 are predicted by 3 (row 2) and 5 (row 3); response 2's token 5 by 4 (row 6)
    assert batch.target_col.tolist() == [2, 3, 2, 6, 6] and batch.target_response.tolist() == [0, 0, 1, 2, 3]
    mask = plan_pass(batch, "sdpa").mask[0, 0]
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]  # 6 sees its own sequence only
    assert mask[8].nonzero().flatten().tolist() == [0, 1, 6, 8]  # the last 7 sees [1 2 4] and itself
    assert mask[10].nonzero().flatten().tolist() == [10]  # padding: itself only


@pytest.mark.parametrize("backend", ["sdpa", "segmented"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma", "gpt2"])
@pytest.mark.parametrize("case", list(CASES))
def test_tree_lines_match_stock_separate_passes(arch, case, backend):
    build, depth, lines = CASES[case]
    examples = build(random.Random(len(arch)))
    assert tree_line([examples[e] for e in lines[0]]).depth == depth
    batch = build_tree_batch(examples, lines, pad_multiple=8)
    assert batch.num_real_tokens < sum(ex.unshared_length for ex in examples)  # it shares something
    assert (batch.spans[..., 0] == -1).any()  # and pads
    model = tiny_model(arch, **GEMMA if arch == "gemma" else {})

    def grads():
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    model.zero_grad(set_to_none=True)
    stock = separate_pass_logps(model, examples)
    dpo_loss(stock, batch.pair_better, batch.pair_worse).backward()
    stock_grads = grads().clone()
    model.zero_grad(set_to_none=True)
    prepare_model(model, backend)
    ours = compute_response_logps(model, batch, plan_pass(batch, backend)).sums
    dpo_loss(ours, batch.pair_better, batch.pair_worse).backward()
    assert_within(ours.detach(), stock.detach(), stock.detach().abs().max().item(), k=K_FORWARD, what="sums")
    grad_scale = stock_grads.abs().max().item()
    assert grad_scale > 1e-3
    assert_within(grads(), stock_grads, grad_scale, what="gradients")


def test_the_mask_picture_draws_a_tree_line(tmp_path):
    """The hand example's line (test above): keys on the way to 2+ leaves in the prompt colour, a key with one
    leaf below in a branch colour, forbidden cells white, padding grey."""
    from prefixdpo.core.attention.draw import MASK_COLOURS, draw_mask, mask_image

    examples = [Example((1, 2, 3), ((5, 6), (7,)), ((0, 1),)), Example((1, 2, 4), ((5,), (7,)), ((0, 1),))]
    batch = build_tree_batch(examples, pad_multiple=4)
    img = mask_image(batch)
    assert tuple(img[4, 2]) == MASK_COLOURS["prompt"]  # query 6 over key 3: 3 leads to the leaves 6 and 7
    assert tuple(img[4, 3]) in map(tuple, MASK_COLOURS["branches"])  # key 5 (row 3) leads to leaf 6 only
    assert tuple(img[4, 6]) == MASK_COLOURS["forbidden"] and tuple(img[10, 2]) == MASK_COLOURS["padding"]
    assert draw_mask(batch, tmp_path / "tree.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_segment_plan_cuts_a_tree_line_into_its_runs():
    """The hand example's line [1 2 3 5 6 7 4 5 7]: the first path [1 2 3 5 6] is one causal segment; 7 (after
    [1 2 3]), [4 5] (after [1 2]) and 7 (after [1 2 4]) each go over their gathered ancestors."""
    from prefixdpo.core.attention.segments import line_segments

    examples = [Example((1, 2, 3), ((5, 6), (7,)), ((0, 1),)), Example((1, 2, 4), ((5,), (7,)), ((0, 1),))]
    batch = build_tree_batch(examples, pad_multiple=4)
    assert line_segments(batch.spans) == [
        ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4]), ([5], [0, 1, 2, 5]), ([6, 7], [0, 1, 6, 7]), ([8], [0, 1, 6, 8])]


def test_the_flex_mask_mod_of_a_tree_equals_its_dense_mask_and_runs_like_sdpa(tmp_path, monkeypatch):
    from torch.nn.attention.flex_attention import create_mask

    from prefixdpo.core.attention.masks import block_mask, dense_mask, mask_mod

    examples = depth_3(random.Random(2))
    batch = build_tree_batch(examples, [[0, 1, 2], [3, 4]], pad_multiple=128)
    B, L = batch.input_ids.shape
    dense = dense_mask(batch.spans)
    assert torch.equal(create_mask(mask_mod(batch.spans), B, None, L, L, device="cpu"), dense)
    tiles = dense.reshape(B, 1, L // 32, 32, L // 32, 32).any(dim=(3, 5))
    assert torch.equal(block_mask(batch.spans, block_size=32).to_dense().bool(), tiles)
    assert tiles.float().mean() < 1  # some tiles are skipped: the check is not vacuous

    # kernels cached under another ATEN_CPU_CAPABILITY must not be reused (see test_masks.py)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = tiny_model("qwen2")
    prepare_model(model, "sdpa")
    with torch.no_grad():
        sdpa = compute_response_logps(model, batch, plan_pass(batch, "sdpa")).sums
        try:
            flex = compute_response_logps(model, batch, plan_pass(batch, "flex")).sums
        except Exception as err:  # ATEN_CPU_CAPABILITY=default: inductor has no CPU flex template
            if "not supported for CPU" not in str(err):
                raise
            pytest.skip("compiled FlexAttention is not supported on this CPU capability")
    assert_within(flex, sdpa, sdpa.abs().max().item(), k=K_FORWARD, what="flex vs sdpa sums")


def test_trie_costs_count_the_nodes_a_trie_line_lays_out():
    """The planner's costs (`trie_costs`, counted from common leading runs) equal the nodes `tree_line` really lays
    out: an example's own trie, and what it adds to the line of the example before it, on records that share a
    system prompt, prompts, whole responses and dialogue turns (a prompt that is a prefix of a later one)."""
    from prefixdpo.data.synthetic import shared_prefix_examples
    from prefixdpo.data.tree import trie_costs, trie_order

    examples = [ex for profile in ("shp-like", "multi-turn", "system-prompt")
                for ex in shared_prefix_examples(profile, 6, vocab_size=50, seed=3)]
    examples.append(Example((1, 2), ((3, 4), (3, 4), (3,)), ((0, 2), (1, 2))))  # duplicate responses, a prefix one
    order = trie_order(examples)
    alone, added = trie_costs(examples, order)
    assert alone == [len(tree_line([examples[i]])) for i in order]
    assert added[0] == alone[0] and added[1:] == [
        len(tree_line([examples[a], examples[b]])) - len(tree_line([examples[a]])) for a, b in zip(order, order[1:])]
    assert sum(added) < sum(alone)  # the records really share
