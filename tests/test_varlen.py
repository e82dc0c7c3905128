"""attention='varlen': the plumbing around FlashAttention varlen (segment packing, cu_seqlens, gathers,
scatter back, GQA, both kernel signatures), checked on CPU by substituting a reference kernel with
`varlen_attn`'s signature (per-segment SDPA, causal aligned bottom-right) and comparing against stock
separate passes. Tolerances (fp32, `tolerances.assert_matches_separate_passes`): per-response log-prob sums within
K_FORWARD eps of the largest |sum|, DPO gradients within K eps of their largest entry, as tests/test_equivalence.py,
and one layout in float64; the same on tree lines (`data.tree`, depth 1-3, two
lines with padding: tests/test_tree.py's cases). The real kernel is checked only on CUDA."""

import inspect
import random

import pytest
import torch

from prefixdpo.core.attention import varlen
from prefixdpo.core.attention.backends import resolve_backend
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.core.attention.masks import dense_mask
from prefixdpo.data.batch import build_batch
from prefixdpo.data.tree import build_tree_batch, tree_line
from prefixdpo.errors import ConfigError, UserError
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.core.verify import compare
from conftest import random_examples, tiny_model
from test_tree import CASES as TREE_CASES
from tolerances import assert_matches_separate_passes, float64_model

CASES = {
    "unpacked": None,  # one row per example (K = 2, 4, 2), padded to a multiple of 8
    "packed": [[0, 1, 2]],  # every example in one line
    "packed+padding": [[0, 2], [1]],  # two lines, the second padded
}


def _segments_of(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    """[(q [1, H, nq, D], k [1, Hkv, nk, D], v)] per segment, after checking the packing the kernel relies on."""
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    assert cu_seq_q.device == cu_seq_k.device == query.device
    assert cu_seq_q.shape == cu_seq_k.shape and cu_seq_q[0] == 0 and cu_seq_k[0] == 0
    assert cu_seq_q[-1] == query.shape[0] and cu_seq_k[-1] == key.shape[0] == value.shape[0]
    nq, nk = cu_seq_q.diff().tolist(), cu_seq_k.diff().tolist()
    assert max_q == max(nq) and max_k == max(nk)
    assert all(0 < q <= k for q, k in zip(nq, nk))
    out = []
    for i in range(len(nq)):
        sq, sk = slice(cu_seq_q[i], cu_seq_q[i + 1]), slice(cu_seq_k[i], cu_seq_k[i + 1])
        out.append((query[sq].transpose(0, 1)[None], key[sk].transpose(0, 1)[None], value[sk].transpose(0, 1)[None]))
    return out


def _bottom_right_sdpa(q, k, v, *, scale=None, enable_gqa=False, left=-1):
    """q [1, H, nq, D] over k/v [1, Hkv, nk, D]: query i sees keys 0 .. nk - nq + i (left >= 0: only the last left + 1
    of them, FlashAttention's window_size=(left, 0))."""
    nq, nk = q.shape[2], k.shape[2]
    allowed = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq)
    if left >= 0:
        allowed &= ~torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq - left - 1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)
    return o[0].transpose(0, 1)  # [nq, H, Dv]


def reference_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):
    """torch 2.13's signature; causal only as window_size=(left, 0) (left -1: no window; else FlashAttention's rule:
    a query at position p keeps the keys p - left .. p, aligned bottom-right), GQA only with enable_gqa."""
    left, right = window_size
    assert right == 0 and left >= -1
    if key.shape[1] != query.shape[1]:
        assert enable_gqa
    segs = _segments_of(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    return torch.cat([_bottom_right_sdpa(q, k, v, scale=scale, enable_gqa=enable_gqa, left=left)
                      for q, k, v in segs])


def reference_varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.11's signature: is_causal, no enable_gqa (equal head counts), no scale (1/sqrt(D))."""
    assert is_causal
    assert key.shape[1] == query.shape[1] == value.shape[1]
    segs = _segments_of(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    return torch.cat([_bottom_right_sdpa(q, k, v) for q, k, v in segs])


@pytest.fixture(params=["torch-2.13", "torch-2.11"])
def kernel(request, monkeypatch):
    """Substitute the kernel (and the CUDA check that guards it) with a reference of either signature."""
    fn = reference_varlen_attn if request.param == "torch-2.13" else reference_varlen_attn_2_11
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return fn(*args, **kwargs)

    counted.__signature__ = inspect.signature(fn)  # the plumbing reads the signature
    monkeypatch.setattr(varlen, "varlen_attn", counted)
    monkeypatch.setattr(varlen, "check_available", lambda device: None)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_matches_separate_passes(kernel, arch, case):
    """llama/qwen2: 4 query heads over 2 kv heads (GQA); qwen3: head_dim 8 and q/k norms."""
    result = compare(tiny_model(arch), random_examples(), packs=CASES[case], backend="varlen", pad_multiple=8)
    assert kernel  # the substituted kernel ran
    assert_matches_separate_passes(result)
    assert result.grad_scale > 1e-3  # the gradient compared is not trivially zero


def _use_kernel(monkeypatch, fn):
    """Substitute `fn` (a reference kernel) for varlen_attn, as the `kernel` fixture does."""
    monkeypatch.setattr(varlen, "varlen_attn", fn)
    monkeypatch.setattr(varlen, "check_available", lambda device: None)


@pytest.mark.parametrize("packs", [None, [[0, 1, 2]]])
def test_varlen_slides_a_window_shorter_than_the_sequences(monkeypatch, packs):
    """A window of 6 under sequences of up to 11 tokens (tests/test_equivalence.py's windowed cases): torch 2.13's
    kernel gets `window_size=(5, 0)` and the shared (and packed) lines match separate passes; the same kernel made to
    ignore the window lands far off (the window cuts)."""
    seen = []

    def windowed(*args, window_size=(-1, -1), **kwargs):
        seen.append(tuple(window_size))
        return reference_varlen_attn(*args, window_size=window_size, **kwargs)

    windowed.__signature__ = inspect.signature(reference_varlen_attn)
    _use_kernel(monkeypatch, windowed)
    result = compare(tiny_model("mistral", sliding_window=6), random_examples(), packs=packs, backend="varlen")
    assert set(seen) == {(5, 0)}
    assert_matches_separate_passes(result)

    def unwindowed(*args, window_size=(-1, -1), **kwargs):
        return reference_varlen_attn(*args, window_size=(-1, 0), **kwargs)

    unwindowed.__signature__ = inspect.signature(reference_varlen_attn)
    _use_kernel(monkeypatch, unwindowed)
    result = compare(tiny_model("mistral", sliding_window=6), random_examples(), packs=packs, backend="varlen")
    assert result.logp_diff > 1e-3


def test_a_varlen_kernel_without_windows_refuses_a_sliding_layer_in_one_line(monkeypatch):
    """torch 2.11's kernel takes no window: a sliding layer on varlen is one line naming the backends that slide it."""
    _use_kernel(monkeypatch, reference_varlen_attn_2_11)
    with pytest.raises(ConfigError, match="takes no window .* needs --attention sdpa or flex"):
        compare(tiny_model("mistral", sliding_window=6), random_examples(), backend="varlen")


def test_varlen_matches_separate_passes_in_float64(kernel):
    """float64 (`tolerances.float64_model`): the packed, padded layout agrees to float64 rounding."""
    result = compare(float64_model(tiny_model("qwen3")), random_examples(), packs=CASES["packed+padding"],
                     backend="varlen", pad_multiple=8)
    assert kernel
    assert_matches_separate_passes(result, torch.float64)


def test_varlen_scaling_other_than_inverse_sqrt_head_dim(kernel):
    """gemma2 scales by query_pre_attn_scalar**-0.5 (here 1/16, not 1/sqrt(8)): passed as `scale` to the
    2.13 kernel, folded into the query for the 2.11 kernel. Soft-capping off (only flex reproduces it)."""
    model = tiny_model("gemma2", num_key_value_heads=2, head_dim=8, attn_logit_softcapping=None,
                       query_pre_attn_scalar=256)
    result = compare(model, random_examples(), packs=[[0, 2], [1]], backend="varlen", pad_multiple=8)
    assert_matches_separate_passes(result)


def test_standard_sequences_packed_match_separate_passes(kernel):
    """prefix_sharing=False: every [prompt][response] is a document with one segment."""
    result = compare(tiny_model("qwen2"), random_examples(), packs=[[0, 2], [1]], backend="varlen",
                     pad_multiple=8, prefix_sharing=False)
    assert_matches_separate_passes(result)


def test_carrier_dispatches_one_kernel_call_per_layer(kernel):
    """One varlen call per layer for the whole two-line batch, over every real token as a query."""
    model = tiny_model("llama", num_hidden_layers=3)
    prepare_model(model, "varlen")
    batch = build_batch(random_examples(), packs=[[0, 2], [1]], pad_multiple=8)
    with torch.no_grad():
        compute_response_logps(model, batch, plan_pass(batch, "varlen"))
    real_tokens = int((batch.spans[..., 0] >= 0).sum())
    assert kernel == [torch.Size([real_tokens, 4, 8])] * 3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(TREE_CASES))
def test_varlen_on_tree_lines_matches_separate_passes(kernel, arch, case):
    """Tree lines of depth 1, 2 and 3 (records of one prompt; a system prompt; dialogues), two lines, padded."""
    build, depth, lines = TREE_CASES[case]
    examples = build(random.Random(len(arch)))
    assert tree_line([examples[e] for e in lines[0]]).depth == depth
    result = compare(tiny_model(arch), examples, packs=lines, backend="varlen", pad_multiple=8, tree=True)
    assert kernel  # the substituted kernel ran
    assert_matches_separate_passes(result)
    assert result.grad_scale > 1e-3


def _covered_pairs(plan: varlen.VarlenPlan) -> torch.Tensor:
    """[B*L, B*L] bool: the (query, key) pairs the plan's segments compute under bottom-right causality; asserts
    that every query is in one segment only."""
    n = plan.batch_size * plan.length
    covered = torch.zeros(n, n, dtype=torch.bool)
    cq, ck = plan.cu_seq_q.tolist(), plan.cu_seq_k.tolist()
    for i in range(plan.num_segments):
        q, k = plan.q_index[cq[i]:cq[i + 1]], plan.kv_index[ck[i]:ck[i + 1]]
        allowed = torch.ones(len(q), len(k), dtype=torch.bool).tril(diagonal=len(k) - len(q))
        for j in range(len(q)):
            assert not covered[q[j]].any()  # each query in one segment only
            covered[q[j], k[allowed[j]]] = True
    return covered


def _check_plan_covers(plan: varlen.VarlenPlan, dense: torch.Tensor, real: torch.Tensor) -> None:
    """The plan computes exactly the pairs of `dense` [B, L, L] among real tokens (`real` [B*L]), none with padding,
    and reads every query back in place."""
    covered = _covered_pairs(plan)
    expected = torch.block_diag(*[dense[b] for b in range(dense.shape[0])])
    assert torch.equal(covered[real][:, real], expected[real][:, real])
    assert not covered[~real].any() and not covered[:, ~real].any()  # padding neither queries nor keys
    assert torch.equal(plan.out_index[real], torch.arange(int(real.sum())))  # every query read back in place
    assert (plan.out_index[~real] == plan.q_index.numel()).all()  # padding reads the zero row


def test_tree_plan_covers_exactly_the_tree_rule():
    """On tree lines of depth 3 (two lines, padded) the varlen plan's pairs are the tree mask's, and the pass
    plan built for varlen holds that plan."""
    build, _, lines = TREE_CASES["depth-3"]
    batch = build_tree_batch(build(random.Random(0)), lines, pad_multiple=8)
    plan = plan_pass(batch, "varlen").mask
    assert plan.num_segments > 2 * len(lines)  # several runs per line
    _check_plan_covers(plan, dense_mask(batch.spans)[:, 0], (batch.spans[..., 0] >= 0).flatten())


def test_plan_covers_exactly_the_allowed_pairs():
    """The (query, key) pairs of the packed segments under bottom-right causality are the dense rule's."""
    batch = build_batch(random_examples(), packs=[[0, 2], [1]], pad_multiple=8)
    plan = varlen.build_varlen_plan(batch.spans)
    _check_plan_covers(plan, dense_mask(batch.spans)[:, 0], (batch.spans[..., 0] >= 0).flatten())


def test_padding_positions_get_zeros(kernel):
    batch = build_batch(random_examples(), packs=[[0, 2], [1]], pad_multiple=8)
    plan = plan_pass(batch, "varlen").mask
    B, L = batch.input_ids.shape
    q, k, v = torch.randn(B, 4, L, 8), torch.randn(B, 2, L, 8), torch.randn(B, 2, L, 8)
    out = varlen.varlen_attention(q, k, v, plan)
    assert out.shape == (B, L, 4, 8)
    pad = batch.spans[..., 0] < 0
    assert pad.any() and (out[pad] == 0).all() and (out[~pad] != 0).any()


def test_varlen_refused_on_cpu_in_one_line():
    with pytest.raises(ConfigError) as err:
        resolve_backend("varlen", "cpu")
    assert issubclass(ConfigError, UserError)  # printed as one line by the CLI, exit 2
    message = str(err.value)
    assert "\n" not in message and "varlen" in message and "CUDA" in message


def test_varlen_refused_where_torch_lacks_the_kernel(monkeypatch):
    monkeypatch.setattr(varlen, "varlen_attn", None)
    with pytest.raises(ConfigError, match="torch >= 2.11"):
        resolve_backend("varlen", "cuda")


def test_auto_stays_flex_on_cuda():
    assert resolve_backend("auto", "cuda") == "flex"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real FlashAttention varlen kernel needs CUDA")
def test_real_kernel_on_cuda():
    """bf16 against separate passes (verify's bf16 tolerance, 5e-2 relative), on prefix-shared and on tree lines;
    fp32 refused in one line."""
    model = tiny_model("qwen2").cuda()
    with pytest.raises(ConfigError, match="bfloat16/float16"):
        compare(model, random_examples(), packs=[[0, 2], [1]], backend="varlen", pad_multiple=8)
    result = compare(model.to(torch.bfloat16), random_examples(), packs=[[0, 2], [1]], backend="varlen", pad_multiple=8)
    assert result.ok(5e-2, 5e-2), result
    build, _, lines = TREE_CASES["depth-3"]  # tree lines through the real kernel
    result = compare(model, build(random.Random(0)), packs=lines, backend="varlen", pad_multiple=8, tree=True)
    assert result.ok(5e-2, 5e-2), result
