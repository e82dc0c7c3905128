"""Chunked log-probs equal unchunked ones, and the largest tensor alive scales with the chunk, not tokens x vocab."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prefixdpo.core.logprobs import token_logps

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
        assert torch.allclose(out, full, atol=1e-5, rtol=0)
        g = torch.autograd.grad(out.sum(), [hidden, head.weight])
        for a, b in zip(g, g_full):
            assert torch.allclose(a, b, atol=1e-5, rtol=0)


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


def test_wpo_sums_equal_full_logits_reference_and_leave_logps_unchanged():
    """WPO's aligned log-prob, log p(y_t) - log sum_v p(v)^2, summed per response from the chunked pass
    equals the same from full [T, V] logits: fp32, relative 1e-6 (sums of ~40 tokens reach ~600 nats, whose
    fp32 spacing is 6e-5); the log-prob sums are those of the plain pass."""
    import types

    from prefixdpo.core.logprobs import response_logps

    f, head, hidden, targets = head_and_inputs(1)
    g = torch.Generator().manual_seed(3)
    target_response = torch.sort(torch.randint(0, 7, (T,), generator=g)).values
    batch = types.SimpleNamespace(target_line=torch.zeros(T, dtype=torch.long), target_col=torch.arange(T),
                                  target_ids=targets, target_response=target_response, num_responses=7)
    logits = head(hidden).float()
    log_probs = torch.log_softmax(logits, -1)
    aligned = log_probs.gather(1, targets[:, None]).squeeze(1) - torch.log((log_probs.exp() ** 2).sum(-1))
    expected = torch.zeros(7).index_add(0, target_response, aligned.detach())
    plain = response_logps(hidden[None], batch, f, chunk_size=13)
    for chunk in (1, 13, 1000):
        out = response_logps(hidden[None], batch, f, chunk_size=chunk, wpo=True)
        assert torch.allclose(out.wpo_sums, expected, atol=0, rtol=1e-6)
        assert not out.wpo_sums.requires_grad  # TRL's weights carry no gradient
        assert torch.allclose(out.sums, plain.sums, atol=0, rtol=1e-6) and out.sums.requires_grad
    assert plain.wpo_sums is None
    # sum_v p^2 <= max_v p, so the aligned log-prob is not the log-prob itself
    assert (expected - plain.sums.detach()).abs().min() > 1e-3


def test_positions_in_response_and_ld_split_by_hand():
    from prefixdpo.core.logprobs import ld_pair_logps, positions_in_response

    # responses 0 (3 tokens), 1 (5), 2 (1), 3 (2); targets interleaved as packed lines order them
    target_response = torch.tensor([0, 0, 1, 1, 0, 1, 2, 1, 3, 1, 3])
    assert positions_in_response(target_response, 4).tolist() == [0, 1, 0, 1, 2, 2, 0, 3, 0, 4, 1]
    per_token = torch.tensor([-1.0, -2.0, -10.0, -20.0, -4.0, -30.0, -7.0, -40.0, -100.0, -50.0, -200.0])
    counts = torch.tensor([3, 5, 1, 2])
    better, worse = torch.tensor([0, 0, 3]), torch.tensor([1, 2, 1])
    alpha = 0.25
    chosen, rejected = ld_pair_logps(per_token, target_response, counts, better, worse, alpha)
    # pair (0, 1): shared length 3 -> response 1's tokens 4 and 5 (-40, -50) are its tail
    # pair (0, 2): shared length 1 -> response 0's tokens 2 and 3 (-2, -4) are its tail
    # pair (3, 1): shared length 2 -> response 1's tokens 3..5 (-30, -40, -50) are its tail
    assert chosen.tolist() == [-7.0, -1.0 + alpha * -6.0, -300.0]
    assert rejected.tolist() == [-60.0 + alpha * -90.0, -7.0, -30.0 + alpha * -120.0]
    # alpha = 1 is the plain sums
    chosen, rejected = ld_pair_logps(per_token, target_response, counts, better, worse, 1.0)
    sums = torch.zeros(4).index_add(0, target_response, per_token)
    assert chosen.tolist() == sums[better].tolist() and rejected.tolist() == sums[worse].tolist()


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
