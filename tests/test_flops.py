"""Useful-FLOP model: hand-counted tiny cases, a brute-force check of the pair counts, config reading."""

import itertools

import pytest
from transformers import LlamaConfig

from prefixdpo_tools.bench.flops import (
    LLAMA_3_1_8B,
    ModelShape,
    forward_flops,
    ideal_speedup,
    shared_flop_count,
    shared_flops,
    standard_flop_count,
    standard_flops,
)
from prefixdpo.data.example import Example
from prefixdpo.data.synthetic import synthetic_examples

# hidden 4, intermediate 8, 2 layers, 2 heads of dim 2, 1 kv head, vocab 10.
TINY = ModelShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10)
# prompt of 3 tokens, responses of 2 and 1.
EX = Example(prompt_ids=(5, 6, 7), response_ids=((8, 9), (4,)))


def test_body_params_by_hand():
    # per layer: q + o = 2*4*(2*2) = 32; k + v = 2*4*(1*2) = 16; SwiGLU 3*4*8 = 96 -> 144; x 2 layers.
    assert TINY.body_params_per_token() == 288


def test_standard_by_hand():
    # [p p p a a]: 5 tokens, 1+2+3+4+5 = 15 pairs, 2 head positions; [p p p b]: 4 tokens, 10 pairs, 1 head.
    c = standard_flop_count(TINY, EX)
    assert c.body == 2 * 288 * 9 == 5184
    assert c.attention == 2 * 4 * 2 * 2 * 25 == 800
    assert c.lm_head == 2 * 4 * 10 * 3 == 240
    assert standard_flops(TINY, EX) == 6224


def test_shared_by_hand():
    # [p p p a a b]: prompt rows see 1,2,3 keys = 6; a1 sees ppp+a1 = 4, a2 sees ppp+a1a2 = 5;
    # b sees ppp+b = 4 (not a): 6 + 9 + 4 = 19 pairs, 6 tokens, same 3 head positions.
    c = shared_flop_count(TINY, EX)
    assert c.body == 2 * 288 * 6 == 3456
    assert c.attention == 32 * 19 == 608
    assert c.lm_head == 240
    assert shared_flops(TINY, EX) == 4304
    assert ideal_speedup(TINY, [EX]) == pytest.approx(6224 / 4304)


def _brute_force_pairs(p, responses):
    """Allowed (q, kv) pairs of the DESIGN.md rule on a prefix-shared row, by enumeration."""
    branch = [0] * p + [k + 1 for k, r in enumerate(responses) for _ in range(r)]
    return sum(
        kv <= q and branch[kv] in (0, branch[q]) for q, kv in itertools.product(range(len(branch)), repeat=2)
    )


@pytest.mark.parametrize("p,responses", [(1, [1, 1]), (3, [2, 1]), (7, [4, 9, 2]), (12, [1, 30])])
def test_shared_pair_count_matches_the_mask_rule(p, responses):
    per_pair = 4 * TINY.heads * TINY.head_dim * TINY.layers
    assert shared_flop_count(TINY, (p, responses)).attention == per_pair * _brute_force_pairs(p, responses)


def test_length_tuples_equal_examples_and_speedup_bounds():
    exs = synthetic_examples("tldr", 20, vocab_size=50, seed=2)
    tuples = [(len(e.prompt_ids), [len(r) for r in e.response_ids]) for e in exs]
    assert ideal_speedup(LLAMA_3_1_8B, exs) == ideal_speedup(LLAMA_3_1_8B, tuples)
    # Two responses: at most 2x (everything but the prompt is computed the same on both sides).
    assert 1.0 < ideal_speedup(LLAMA_3_1_8B, exs) < 2.0
    with pytest.raises(ValueError, match="empty"):
        ideal_speedup(TINY, [])


def test_flop_fractions_and_forward_flops():
    f = TINY.flop_fractions([EX])
    assert sum(f.values()) == pytest.approx(1.0)
    assert f["lm_head"] == pytest.approx(240 / 4304)
    assert TINY.flop_fractions([EX], shared=False)["lm_head"] == pytest.approx(240 / 6224)
    assert forward_flops(TINY, 0, 0, 0).total == 0


def test_from_config():
    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256,
    )
    assert ModelShape.from_config(cfg) == LLAMA_3_1_8B
    # kv heads default to heads, head_dim to hidden / heads.
    small = ModelShape.from_config(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, vocab_size=99))
    assert (small.kv_heads, small.head_dim) == (4, 16)
    # Llama-3.1-8B body: about 7.0e9 parameters (8.0e9 minus two 0.5e9 embedding/head matrices).
    assert LLAMA_3_1_8B.body_params_per_token() == pytest.approx(6.98e9, rel=0.01)


def test_a_hybrid_pays_the_pair_term_on_its_attention_layers_only():
    """Qwen3.5-style: two Gated DeltaNet layers and two attention layers of four. Its recurrent layers cost a linear
    term per token, which sharing cuts by the whole token ratio (2600 -> 1600 tokens), while attention keeps every
    response's pairs with the prompt: the hybrid's ideal lies above the all-attention model's, below the token ratio."""
    from transformers import AutoConfig

    from prefixdpo_tools.hybrid_models import HYBRID_FAMILIES
    from prefixdpo_tools.bench.flops import forward_flops, ideal_speedup, layer_kinds

    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    hybrid = AutoConfig.for_model("qwen3_5_text", **fields, **HYBRID_FAMILIES["qwen3_5_text"])
    shape = ModelShape.from_config(hybrid)
    assert layer_kinds(hybrid) == [{"recurrent"}, {"attention"}] * 2
    assert (shape.attention_layers, shape.recurrent_flops_per_token) == (2, 2 * 6 * 4 * 16 * 16)
    plain = ModelShape.from_config(AutoConfig.for_model("qwen3", **fields))
    assert plain.attention_layers is None and plain.recurrent_flops_per_token == 0
    assert forward_flops(shape, 10, 55, 0).attention * 2 == forward_flops(plain, 10, 55, 0).attention
    work = [(1000, [300, 300])]
    assert ideal_speedup(plain, work) < ideal_speedup(shape, work) < 2600 / 1600
    falcon = AutoConfig.for_model("falcon_h1", **fields, **HYBRID_FAMILIES["falcon_h1"])
    assert layer_kinds(falcon) == [{"attention", "recurrent"}] * 4  # Mamba2 and attention side by side in a layer


def test_a_pure_state_space_model_has_no_pair_term_and_its_own_body_weights():
    """A pure Mamba2 (no attention, no Llama names): every layer recurrent, no attended pairs, the body's weights those
    of the model itself (every matrix and convolution kernel but the embeddings and head), the state work 6 x heads x
    head_dim x d_state a layer. Its ideal speedup is then the token ratio up to the LM head's share (2600 -> 1600
    tokens, the head's positions unchanged). Zamba2's Mamba2 layers count their state work by its own names."""
    from transformers import AutoConfig

    from prefixdpo_tools.hybrid_models import HYBRID_FAMILIES, tiny_hybrid_lm
    from prefixdpo_tools.bench.flops import ideal_speedup, layer_kinds, recurrent_layer_flops_per_token

    model = tiny_hybrid_lm("mamba2")
    shape = ModelShape.from_config(model.config)
    assert layer_kinds(model.config) == [{"recurrent"}] * 4
    assert shape.attention_layers == 0 and shape.pair_layers == 0
    assert shape.recurrent_flops_per_token == 4 * 6 * 4 * 16 * 16
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() >= 2 and "embeddings" not in name and "lm_head" not in name)
    assert shape.body_params_per_token() == matrices
    work = [(1000, [300, 300])]
    assert ideal_speedup(shape, work) < 2600 / 1600
    assert ideal_speedup(shape, work) > ideal_speedup(ModelShape.from_config(tiny_hybrid_lm("qwen3_5_text").config),
                                                      work)
    zamba2 = AutoConfig.for_model("zamba2", vocab_size=96, hidden_size=64, num_hidden_layers=4,
                                  **HYBRID_FAMILIES["zamba2"])
    assert recurrent_layer_flops_per_token(zamba2) == 6 * 4 * 16 * 16
