"""Prefix-shared log-probs and DPO gradients equal separate standard passes, in fp32, on tiny models
of several architectures built from configs. Tolerances (`tolerances.assert_matches_separate_passes`):
per-response log-prob sums within K_FORWARD eps of the largest |sum|, gradients within K eps of their largest
entry; each layout kind (prefix-shared rows, segment plan, standard rows packed, tree lines) also in float64."""

import random

import pytest
import torch

from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.core.forward import compute_response_logps

from prefixdpo.core.model_checks import prepare_model
from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.data.batch import build_batch
from prefixdpo.core.verify import compare
from conftest import random_examples, tiny_model
from tolerances import assert_matches_separate_passes, float64_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]

CASES = {
    "unpacked": None,  # one padded row per example (K = 2, 4, 2 with different lengths -> padding)
    "packed": [[0, 1, 2]],  # all in one row
    "packed+padding": [[0, 2], [1]],  # two rows, the second padded
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", list(CASES))
def test_logps_and_grads_match_separate_passes(arch, case):
    model = tiny_model(arch)
    result = compare(model, random_examples(), packs=CASES[case], pad_multiple=8, case=case)
    assert_matches_separate_passes(result)
    assert result.grad_scale > 1e-3  # the gradient compared is not trivially zero


@pytest.mark.parametrize("layout", ["shared", "segmented", "standard packed", "tree"])
def test_every_layout_kind_matches_separate_passes_in_float64(layout):
    """float64 (`tolerances.float64_model`): the same comparisons agree to float64 rounding, so the fp32
    differences above are rounding only."""
    from test_tree import CASES as TREE_CASES

    build, _, lines = TREE_CASES["depth-3"]
    options = {"shared": dict(packs=CASES["packed+padding"]), "segmented": dict(packs=CASES["packed+padding"],
               backend="segmented"), "standard packed": dict(packs=[[0, 2], [1]], prefix_sharing=False),
               "tree": dict(packs=lines, tree=True)}[layout]
    examples = build(random.Random(0)) if layout == "tree" else random_examples()
    result = compare(float64_model(tiny_model("llama")), examples, pad_multiple=8, case=layout, **options)
    assert_matches_separate_passes(result, torch.float64)
    assert result.grad_scale > 1e-3


def test_broken_layout_is_detected():
    """Without the position restart the method is NOT equivalent: the comparison must see it."""
    result = compare(tiny_model("llama"), random_examples(), restart_positions=False)
    assert result.logp_diff > 1e-3  # far outside any rounding


def test_sliding_window_shorter_than_sequence_is_refused_on_a_backend_without_windows(monkeypatch):
    import prefixdpo.core.model_checks as model_checks  # its check_sequences_fit_window refuses it

    # varlen on a torch whose kernel takes no window (torch 2.11; torch 2.13's slides it: tests/test_varlen.py)
    monkeypatch.setattr(model_checks, "WINDOWED_BACKENDS", ("sdpa", "flex", "segmented"))
    model = tiny_model("mistral", sliding_window=6)
    prepare_model(model, "sdpa")
    batch = build_batch(random_examples())
    mask = plan_pass(batch, "varlen")
    with pytest.raises(UnsupportedModelError, match="sliding-window attention .* or use --attention sdpa or flex"):
        compute_response_logps(model, batch, mask)


@pytest.mark.parametrize("backend", ["sdpa", "segmented"])
@pytest.mark.parametrize("packs", [None, [[0, 1, 2]]])
def test_sliding_window_shorter_than_sequences_is_exact(packs, backend):
    """A window of 6 under sequences of up to 11 tokens: the dense mask (`masks.dense_mask`) and each segment's mask
    (`segments._group_mask`, with no causal shortcut where the window cuts) slide it along each sequence of a shared
    (and packed) line."""
    result = compare(tiny_model("mistral", sliding_window=6), random_examples(), packs=packs, backend=backend)
    assert_matches_separate_passes(result)


def test_sliding_window_longer_than_sequences_is_exact():
    result = compare(tiny_model("mistral", sliding_window=17), random_examples(), packs=[[0, 1, 2]])
    assert_matches_separate_passes(result)


def test_attention_softcapping_refused_on_sdpa():
    model = tiny_model("gemma2", num_key_value_heads=2, head_dim=8)
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        prepare_model(model, "sdpa")


def test_final_logit_softcapping_head_is_reproduced():
    """gemma2-style final soft-capping is applied on our head path (checked against the model's logits)."""
    from prefixdpo.core.logprobs import check_head, lm_head_fn

    model = tiny_model("gemma2", num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.5)
    h = torch.randn(3, model.config.hidden_size)
    logits = torch.tanh(model.lm_head(h) / 0.5) * 0.5
    check_head(lm_head_fn(model), h, logits)
    with pytest.raises(UnsupportedModelError, match="LM head"):
        check_head(lm_head_fn(model), h, model.lm_head(h))


def test_head_check_allows_a_bfloat16_models_rounding_but_not_a_missed_cap():
    """A bfloat16 model's logits are its fp32 logits rounded (then soft-capped in bfloat16, as Gemma-2 does on a GPU):
    within the check's bound; the same logits without the cap are still refused."""
    from prefixdpo.core.logprobs import check_head, lm_head_fn

    model = tiny_model("gemma2", num_key_value_heads=2, head_dim=8, final_logit_softcapping=30.0)
    torch.manual_seed(0)
    h = torch.randn(3, model.config.hidden_size) * 20
    raw = model.lm_head(h)
    capped_in_bf16 = (torch.tanh(raw.bfloat16() / 30.0) * 30.0).bfloat16()
    ours = lm_head_fn(model)(h)
    assert (ours - capped_in_bf16.float()).abs().max() > 1e-3 * max(1.0, capped_in_bf16.float().abs().max().item())
    check_head(lm_head_fn(model), h, capped_in_bf16)
    with pytest.raises(UnsupportedModelError, match="LM head"):
        check_head(lm_head_fn(model), h, raw.bfloat16())


def test_encoder_decoder_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        prepare_model(model, "sdpa")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", ["unpacked", "packed+padding"])
def test_segmented_backend_matches_separate_passes(arch, case):
    result = compare(tiny_model(arch), random_examples(), packs=CASES[case], backend="segmented", pad_multiple=8)
    assert_matches_separate_passes(result)


def test_segmented_plan_covers_only_allowed_pairs():
    """Every (query, key) pair the plan computes is allowed by the dense rule, and every allowed pair is computed."""
    from prefixdpo.core.attention.masks import dense_mask
    from prefixdpo.core.attention.segments import build_segment_plan

    batch = build_batch(random_examples(), packs=[[0, 2], [1]], pad_multiple=8)
    B, L = batch.input_ids.shape
    plan = build_segment_plan(batch.spans)
    covered = torch.zeros(B * L, B * L, dtype=torch.bool)
    q_at = k_at = 0
    for g in plan.groups:
        q = plan.q_index[q_at:q_at + g.num_segments * g.num_queries].view(g.num_segments, g.num_queries)
        k = plan.kv_index[k_at:k_at + g.num_segments * g.num_keys].view(g.num_segments, g.num_keys)
        q_at += q.numel()
        k_at += k.numel()
        for s in range(g.num_segments):
            m = g.mask()[s, 0]
            for i in range(g.num_queries):
                real_query = plan.out_index[q[s, i]] == q_at - q.numel() + s * g.num_queries + i
                if real_query:
                    covered[q[s, i], k[s][m[i]]] = True
    dense = dense_mask(batch.spans)[:, 0]
    expected = torch.block_diag(*[dense[b] for b in range(B)])
    real = (batch.spans[..., 0] >= 0).flatten()
    assert torch.equal(covered[real][:, real], expected[real][:, real])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("packs", [[[0, 1, 2]], [[0, 2], [1]]], ids=["one-line", "two-lines+padding"])
def test_standard_sequences_packed_match_separate_passes(arch, packs):
    """prefix_sharing=False, packed: every [prompt][response] is its own document in the line."""
    result = compare(tiny_model(arch), random_examples(), packs=packs, pad_multiple=8, prefix_sharing=False)
    assert_matches_separate_passes(result)
    assert result.grad_scale > 1e-3

