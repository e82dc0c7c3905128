"""Chunked log-probs equal unchunked ones (`tolerances`: values within K_FORWARD eps of their largest |value|,
gradients K eps of their largest entry), and the largest tensor alive scales with the chunk, not tokens x vocab."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prefixdpo.core.logprobs import token_logps
from tolerances import K_FORWARD, assert_within

V, D, T = 512, 16, 300


def head_and_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
    hidden = torch.randn(T, D, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (T,), generator=g)
    return (lambda h: head(h).float()), head, hidden, targets


def test_chunked_equals_unchunked_values_and_grads():
    f, head, hidden, targets = head_and_inputs()
    full = torch.log_softmax(head(hidden), -1).gather(1, targets[:, None]).squeeze(1)
    g_full = torch.autograd.grad(full.sum(), [hidden, head.weight])
    for chunk in (1, 7, 64, 1000):
        out = token_logps(f, hidden, targets, chunk_size=chunk)
        assert_within(out, full, full.abs().max().item(), k=K_FORWARD, what=f"chunk {chunk} log-probs")
        g = torch.autograd.grad(out.sum(), [hidden, head.weight])
        for name, a, b in zip(("hidden", "head"), g, g_full):
            assert_within(a, b, b.abs().max().item(), what=f"chunk {chunk} {name} gradient")


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def largest_tensor(chunk: int) -> int:
    f, head, hidden, targets = head_and_inputs()
    with LargestTensor() as mode:
        token_logps(f, hidden, targets, chunk_size=chunk).sum().backward()
    return mode.largest


def test_peak_tensor_grows_with_chunk_not_tokens_times_vocab():
    small, big = largest_tensor(16), largest_tensor(128)
    # forward and backward (recomputed logits) never hold more than chunk x vocab at once
    assert small <= 16 * V < T * V
    assert big <= 128 * V
    assert big > small  # it really is the chunk that bounds it
    # and an unchunked pass would hold tokens x vocab
    assert largest_tensor(T) >= T * V


def test_inside_the_engine_forward_equals_the_head_applied_after_the_model():
    """`compute_response_logps` runs the head inside the wrapped module's forward (`forward.through_engine`);
    it must give what the earlier design gave: the model run alone, its final hidden states captured, the
    head applied after it. Values and gradients, fp32, 1e-6; and the model's own forward is restored."""
    from conftest import make_examples, tiny_model

    from prefixdpo.data.batch import build_batch
    from prefixdpo.core.forward import compute_response_logps
    from prefixdpo.core.model_checks import prepare_model, unwrap
    from prefixdpo.core.logprobs import lm_head_fn, response_logps
    from prefixdpo.core.attention.pass_plan import plan_pass

    model = tiny_model("llama")
    prepare_model(model, "sdpa")
    batch = build_batch(make_examples(3, ks=(2, 3)), prefix_sharing=True, pad_token_id=0)
    plan = plan_pass(batch, "sdpa")
    ours = compute_response_logps(model, batch, plan, chunk_size=5)
    (g_ours,) = torch.autograd.grad(ours.sums.sum(), model.lm_head.weight)
    assert "forward" not in model.__dict__  # the engine-level redirection left no trace

    captured = []
    handle = model.model.register_forward_hook(lambda _m, _i, out: captured.append(out.last_hidden_state))
    model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, attention_mask=plan.mask)
    handle.remove()
    before = response_logps(captured[0], batch, lm_head_fn(unwrap(model)), 5)
    (g_before,) = torch.autograd.grad(before.sums.sum(), model.lm_head.weight)
    assert torch.allclose(ours.sums, before.sums, rtol=0, atol=1e-6 * before.sums.abs().max().item())
    assert torch.equal(ours.counts, before.counts)
    assert torch.allclose(g_ours, g_before, rtol=0, atol=1e-6 * g_before.abs().max().item())


# ---- a plain linear head as one autograd function (`LinearHead`) vs the checkpointed module call


def _linear_and_module_heads(bias: bool, scale_div, scale_mul, dtype, seed=1):
    from prefixdpo.core.logprobs import ModelHead

    g = torch.Generator().manual_seed(seed)
    module = torch.nn.Linear(D, V, bias=bias).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(V, D, generator=g))
        if bias:
            module.bias.copy_(torch.randn(V, generator=g))
    hidden = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    head = ModelHead(module, scale_div, scale_mul, softcap=None)
    generic = ModelHead(module, scale_div, scale_mul, softcap=None)
    generic.linear = None  # the module call under checkpointing: autograd's own backward
    return head, generic, module, hidden, targets


import pytest  # noqa: E402


@pytest.mark.parametrize("bias,scale_div,scale_mul,dtype", [
    (False, None, None, torch.float32), (True, None, None, torch.float32), (False, 3.0, None, torch.float32),
    (True, None, 0.0625, torch.float32), (False, None, None, torch.bfloat16), (False, None, None, torch.float64),
])
def test_a_linear_head_runs_as_one_function_with_autograd_numbers(bias, scale_div, scale_mul, dtype):
    """Values and the gradients of hidden, weight and bias equal the checkpointed module call's: the function's
    backward is autograd's own operations (asserted within K_FORWARD eps of the scale: a wrong sign or a missing
    target term moves them by O(1) of it; measured equal to the bit here)."""
    head, generic, module, hidden, targets = _linear_and_module_heads(bias, scale_div, scale_mul, dtype)
    assert head.linear is not None
    weights = torch.linspace(-1, 2, T)  # per-token upstream gradients, as a DPO loss gives
    params = [hidden, module.weight] + ([module.bias] if bias else [])
    results = []
    for h in (head, generic):
        out = token_logps(h, hidden, targets, chunk_size=128)
        results.append((out, torch.autograd.grad((out * weights).sum(), params)))
    (ours, ours_grads), (ref, ref_grads) = results
    assert_within(ours, ref, ref.abs().max().item(), dtype, k=K_FORWARD, what="log-probs")
    for name, a, b in zip(("hidden", "weight", "bias"), ours_grads, ref_grads):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_within(a, b, b.abs().max().item(), dtype, k=K_FORWARD, what=f"{name} gradient")


def test_a_frozen_linear_head_gives_the_hidden_gradient_only():
    head, generic, module, hidden, targets = _linear_and_module_heads(False, None, None, torch.float32)
    module.weight.requires_grad_(False)
    out = token_logps(head, hidden, targets, chunk_size=64)
    (g,) = torch.autograd.grad(out.sum(), hidden)
    (g_ref,) = torch.autograd.grad(token_logps(generic, hidden, targets, chunk_size=64).sum(), hidden)
    assert_within(g, g_ref, g_ref.abs().max().item(), k=K_FORWARD, what="hidden gradient")


def test_a_head_an_engine_or_adapter_acts_on_keeps_the_module_call():
    """FSDP2's per-module class, ZeRO-3's gather hooks, accelerate's offload hook or a LoRA layer act at the head's
    call: such a head is not read as a plain weight (`linear` None), nor one with soft-capping."""
    from prefixdpo.core.logprobs import ModelHead

    plain = torch.nn.Linear(D, V, bias=False)
    assert ModelHead(plain, None, None, None).linear is not None
    assert ModelHead(plain, None, None, softcap=30.0).linear is None
    hooked = torch.nn.Linear(D, V, bias=False)
    hooked.register_forward_pre_hook(lambda module, args: None)
    assert ModelHead(hooked, None, None, None).linear is None
    offloaded = torch.nn.Linear(D, V, bias=False)
    offloaded._hf_hook = object()
    assert ModelHead(offloaded, None, None, None).linear is None

    class Adapter(torch.nn.Linear):
        pass

    assert ModelHead(Adapter(D, V, bias=False), None, None, None).linear is None


def test_the_linear_head_holds_no_more_than_a_chunk_of_logits():
    from prefixdpo.core.logprobs import ModelHead

    _, head, hidden, targets = head_and_inputs()
    fused = ModelHead(head, None, None, None)
    for chunk in (16, 128):
        with LargestTensor() as mode:
            token_logps(fused, hidden, targets, chunk_size=chunk).sum().backward()
        assert mode.largest <= chunk * V


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logsumexp_in_place_is_torchs_logsumexp_to_the_bit(dtype):
    """The linear head's forward takes each row's logsumexp in the logits' own storage: the same operations as
    torch.logsumexp, so the same bits, on rows of ordinary logits, large ones, and rows holding -inf, +inf, NaN
    or only -inf; vocabulary widths that are and are not a multiple of the vector width."""
    from prefixdpo.core.logprobs import logsumexp_in_place

    g = torch.Generator().manual_seed(3)
    for rows, vocab in ((7, 49152), (33, 1000), (5, 3)):
        logits = torch.randn(rows, vocab, generator=g, dtype=dtype) * 30
        logits[0] += 1e4
        logits[1, ::2] = float("-inf")
        logits[2, 1] = float("inf")
        logits[3] = float("-inf")
        logits[4, 0] = float("nan")
        expected = torch.logsumexp(logits, dim=-1)
        torch.testing.assert_close(logsumexp_in_place(logits.clone()), expected, rtol=0, atol=0, equal_nan=True)
