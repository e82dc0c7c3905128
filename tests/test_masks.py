"""The attention rule: dense mask == FlexAttention mask_mod element-wise, and flex == sdpa on CPU (no grad)."""

import pytest
import torch

from prefixdpo.core.attention.masks import block_mask, dense_mask, mask_mod
from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo.core.attention.pass_plan import plan_pass
from conftest import random_examples, tiny_model
from tolerances import K_FORWARD, assert_within


def packed_batch():
    exs = random_examples() + [Example([5, 6, 7], [[8, 9], [10]])]
    return build_batch(exs, packs=[[0, 3], [1], [2]], length=128)  # packed rows with padding


def test_dense_mask_hand_case():
    # one trie: prompt (2 tokens; their subtree: the whole row), response A (2), response B (1), then 1 padding slot
    tin = torch.tensor([[0, 1, 2, 3, 4, -1]])
    tout = torch.tensor([[5, 5, 4, 4, 5, -1]])
    m = dense_mask(torch.stack([tin, tout], dim=-1))[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # response B sees the prompt and itself, not response A
        [0, 0, 0, 0, 0, 1],  # padding sees only itself (no all-masked row -> no NaN)
    ]


def test_dense_mask_equals_flex_mask_mod():
    from torch.nn.attention.flex_attention import create_mask

    batch = packed_batch()
    B, L = batch.input_ids.shape
    from_mod = create_mask(mask_mod(batch.spans), B, None, L, L, device="cpu")
    dense = dense_mask(batch.spans)
    assert from_mod.shape == dense.shape == (B, 1, L, L)
    assert torch.equal(from_mod, dense)
    # the BlockMask built on CPU skips exactly the tiles where the dense mask is all False
    bm = block_mask(batch.spans, block_size=32)
    tiles = dense.reshape(B, 1, L // 32, 32, L // 32, 32).any(dim=(3, 5))
    assert torch.equal(bm.to_dense().bool(), tiles)
    assert tiles.float().mean() < 1  # some tiles are skipped: the check is not vacuous


def test_padding_rows_give_finite_gradients():
    """All-masked padded query rows would turn into NaN in SDPA; the self-attend clause prevents it."""
    from prefixdpo.core.forward import compute_response_logps
    from prefixdpo.core.model_checks import prepare_model

    model = tiny_model("llama")
    prepare_model(model, "sdpa")
    batch = packed_batch()
    out = compute_response_logps(model, batch, plan_pass(batch, "sdpa"))
    out.sums.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not _flex_available(), reason="this torch has no FlexAttention")
# a sliding window of 5, shorter than the packed sequences: flex's windowed BlockMask (`pass_plan.plan_mask`)
@pytest.mark.parametrize("config", [{}, dict(use_sliding_window=True, sliding_window=5, max_window_layers=0)])
def test_flex_forward_matches_sdpa_on_cpu(tmp_path, monkeypatch, config):
    from prefixdpo.core.forward import compute_response_logps
    from prefixdpo.core.model_checks import prepare_model

    # A private inductor cache: measured, kernels cached under one ATEN_CPU_CAPABILITY and reused under
    # another (avx512 -> avx2) gave log-probs off by 6.0; the cache key does not include the capability.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = tiny_model("qwen2", **config)
    batch = packed_batch()
    assert not config or batch.max_sequence_length > config["sliding_window"]
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


def test_flex_training_on_cpu_is_refused():
    from prefixdpo.core.attention.backends import resolve_backend

    with pytest.raises(ValueError, match="no CPU backward"):
        resolve_backend("flex", "cpu", needs_grad=True)
    assert resolve_backend("auto", "cpu") == "sdpa"
    assert resolve_backend("auto", "cuda") == "flex"


def test_choosing_flex_leaves_room_for_its_compiled_variants():
    """Dynamo's default of 8 compiled variants of flex_attention was hit on an H200 (grad mode, training flag,
    shapes), after which flex ran its unfused eager path: choosing flex raises the limit, never lowers one."""
    import torch._dynamo.config as dynamo_config

    from prefixdpo.core.attention.backends import resolve_backend
    from prefixdpo.core.attention.flex_compile import FLEX_RECOMPILE_LIMIT

    with dynamo_config.patch(recompile_limit=8):  # the config's own patch restores it (monkeypatch would delete it)
        assert resolve_backend("sdpa", "cpu") == "sdpa" and dynamo_config.recompile_limit == 8
        assert resolve_backend("flex", "cpu", needs_grad=False) == "flex"
        assert dynamo_config.recompile_limit == FLEX_RECOMPILE_LIMIT
    with dynamo_config.patch(recompile_limit=500):
        resolve_backend("flex", "cpu", needs_grad=False)
        assert dynamo_config.recompile_limit == 500
