"""gpt-oss (attention sinks, sliding windows) on prefix-shared lines, exact on the CPU's dense-mask backend.

The sdpa backend runs gpt-oss's own eager attention with its sinks over the rule's mask (`core.attention.sinks`) and
slides each sliding layer's window along every sequence of a shared line (`masks.dense_mask`). Against stock separate
passes (gpt-oss's own eager attention, each `[prompt][response]` alone: `core.verify.separate_pass_logps`), every
response's log-prob sum is within K_FORWARD eps x the largest |sum| and every gradient of a DPO-shaped loss within
K eps x the largest entry (`tolerances`), fp32, on a paired line, a line of K = 4 responses, two examples packed in a
padded line and a trie across records. The window is 5 (sequences of up to 15 tokens) and the sinks are drawn at
std 1, so both change the numbers: without the window a trie's sums are ~8 nats off.
"""

from __future__ import annotations

import functools

import pytest
import torch

from prefixdpo.core.attention.masks import dense_mask
from prefixdpo.core.fit import longest_sequence
from prefixdpo.core.model_checks import prepare_model, refusal
from prefixdpo_tools.hybrid_models import tiny_hybrid_lm
from test_recurrent_exact import differences, layouts
from tolerances import K, K_FORWARD, assert_small

WINDOW = 5


@functools.lru_cache(maxsize=None)
def gpt_oss():
    model = tiny_hybrid_lm("gpt_oss", sliding_window=WINDOW)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    assert prepare_model(model, "sdpa") == "sdpa"  # prefixdpo's attention, not the stock route
    return model


@pytest.mark.parametrize("backend", ["sdpa", "segmented"])
@pytest.mark.parametrize("layout", ["paired", "k4", "packed", "trie"])
def test_gpt_oss_shared_lines_match_stock_separate_passes(layout, backend):
    """On sdpa, the eager attention over the line's whole mask; on segmented, over each group of segments' mask."""
    examples, options = layouts()[layout]
    assert max(map(longest_sequence, examples)) >= 2 * WINDOW  # the window cuts into every layout
    logp_diff, logp_scale, grad_diff, grad_scale = differences(gpt_oss(), examples, backend, **options)
    assert_small(logp_diff, logp_scale, k=K_FORWARD, what=f"gpt_oss {backend} {layout} sums")
    assert_small(grad_diff, grad_scale, k=K, what=f"gpt_oss {backend} {layout} gradients")
    eps = torch.finfo(torch.float32).eps
    print(f"REPORT gpt_oss {backend} {layout}: sums {logp_diff / logp_scale / eps:.2f}, gradients "
          f"{grad_diff / grad_scale / eps:.2f} eps x their scale")


def test_the_window_slides_along_each_sequence_as_transformers_does():
    """On one plain sequence the windowed rule is transformers' sliding-window causal mask; on a shared line each
    response's window reaches back into its prompt, never into the other response."""
    L = 9
    chain = torch.stack([torch.arange(L), torch.full((L,), L)], -1)[None]  # one sequence: each token a chain node
    q, kv = torch.arange(L)[:, None], torch.arange(L)[None]
    expected = (kv <= q) & (kv > q - 3)
    assert torch.equal(dense_mask(chain, window=3)[0, 0], expected)
    # [p0 p1 p2 | a0 a1 | b0 b1 b2]: a's and b's tokens continue the prompt's positions
    tout = [8, 8, 8, 5, 5, 8, 8, 8]
    spans = torch.tensor([[i, t] for i, t in enumerate(tout)])[None]
    mask = dense_mask(spans, window=3)[0, 0]
    assert mask[7].nonzero().flatten().tolist() == [5, 6, 7]  # b2 at position 5: b0, b1 and itself
    assert mask[5].nonzero().flatten().tolist() == [1, 2, 5]  # b0 at position 3: p1, p2 and itself (not a0, a1)


@pytest.mark.parametrize("layout", ["paired", "k4", "packed", "trie"])
def test_the_flex_rule_slides_the_same_window(layout):
    """FlexAttention's windowed mask_mod (`masks.depths`: each column's position from the spans alone, equal to the
    lines' position ids) gives, as a dense view (`create_mask`, attention-gym's check), the dense mask's windowed
    rule, for a whole line and for a chunk over a cached prefix (queries from column 8)."""
    from torch.nn.attention.flex_attention import create_mask

    from prefixdpo.core.attention.masks import depths, mask_mod
    from prefixdpo.core.verify import verify_batch

    examples, options = layouts()[layout]
    batch = verify_batch(examples, **options)
    B, L = batch.input_ids.shape
    assert torch.equal(depths(batch.spans), batch.position_ids)
    for queries_from in (0, 8):
        rule = dense_mask(batch.spans, queries_from, WINDOW)
        flex = create_mask(mask_mod(batch.spans, queries_from, WINDOW), B, None, L - queries_from, L, device="cpu")
        assert torch.equal(flex, rule), (layout, queries_from)
        assert not torch.equal(rule, dense_mask(batch.spans, queries_from))  # the window cuts


def test_a_plans_derived_masks_are_built_once_per_pass():
    """Every sliding layer of a pass reads one windowed mask, every sink layer one additive mask (`plan_mask`)."""
    from prefixdpo.core.attention.pass_plan import plan_mask, plan_pass
    from prefixdpo.core.verify import verify_batch

    examples, options = layouts()["trie"]
    batch = verify_batch(examples, **options)
    plan = plan_pass(batch, "sdpa")
    assert plan_mask(plan) is plan.mask
    assert plan_mask(plan, WINDOW) is plan_mask(plan, WINDOW)
    assert torch.equal(plan_mask(plan, WINDOW), dense_mask(batch.spans, window=WINDOW))
    additive = plan_mask(plan, WINDOW, additive=torch.float32)
    assert additive is plan_mask(plan, WINDOW, additive=torch.float32)
    assert torch.equal(additive == 0, plan_mask(plan, WINDOW))
    assert additive.min() == torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match="segmented backend does not slide"):
        plan_mask(plan_pass(batch, "segmented"), WINDOW)


def test_sinks_are_refused_in_one_line_on_the_backend_without_them():
    model = tiny_hybrid_lm("gpt_oss")
    reason = refusal(model, "varlen")
    assert reason is not None and "attention sinks" in reason and "--attention sdpa" in reason
    assert refusal(model, "sdpa") is None and refusal(model, "segmented") is None


def test_without_the_sinks_the_segmented_pass_would_be_off(monkeypatch):
    """The check sees the sinks: the same segmented line with each group's attention run without them (plain SDPA
    over the same additive mask) is far outside the rule, so the segmented pass does run them."""
    from prefixdpo.core.attention import backends
    from prefixdpo.core.verify import separate_pass_logps, verify_batch
    from test_recurrent_exact import line_pass, response_sums

    def without_sinks(module, query, key, value, additive_mask, scaling=None, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=additive_mask,
                                                               scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None

    examples, options = layouts()["paired"]
    batch = verify_batch(examples, **options)
    with torch.no_grad():
        separate = separate_pass_logps(gpt_oss(), examples)
        monkeypatch.setattr(backends, "sink_attention", without_sinks)
        sums = response_sums(line_pass(gpt_oss(), batch, backend="segmented"), batch)
    scale = separate.abs().max().item()
    assert (sums - separate).abs().max().item() > 1000 * K_FORWARD * torch.finfo(torch.float32).eps * scale
