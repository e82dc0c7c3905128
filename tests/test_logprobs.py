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
    from prefixdpo.core.attention.backends import batch_attention_mask

    model = tiny_model("llama")
    prepare_model(model, "sdpa")
    batch = build_batch(make_examples(3, ks=(2, 3)), prefix_sharing=True, pad_token_id=0)
    mask = batch_attention_mask(batch, "sdpa")
    ours = compute_response_logps(model, batch, mask, chunk_size=5)
    (g_ours,) = torch.autograd.grad(ours.sums.sum(), model.lm_head.weight)
    assert "forward" not in model.__dict__  # the engine-level redirection left no trace

    captured = []
    handle = model.model.register_forward_hook(lambda _m, _i, out: captured.append(out.last_hidden_state))
    model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, attention_mask=mask)
    handle.remove()
    before = response_logps(captured[0], batch, lm_head_fn(unwrap(model)), 5)
    (g_before,) = torch.autograd.grad(before.sums.sum(), model.lm_head.weight)
    assert torch.allclose(ours.sums, before.sums, rtol=0, atol=1e-6 * before.sums.abs().max().item())
    assert torch.equal(ours.counts, before.counts)
    assert torch.allclose(g_ours, g_before, rtol=0, atol=1e-6 * g_before.abs().max().item())
