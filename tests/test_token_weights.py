"""TRL's per-token weightings of DPO (prefixdpo.dpo.token_weights): WPO's aligned log-probs from the policy's own
chunked head pass (core's per-token statistic hook), and LD-DPO's per-pair split, against values by hand."""

import types

import torch

from prefixdpo.core.logprobs import response_logps
from prefixdpo.dpo.token_weights import ld_pair_logps, positions_in_response, wpo_aligned_logps
from test_logprobs import T, head_and_inputs
from tolerances import K_FORWARD, assert_within


def test_wpo_aligned_sums_equal_full_logits_reference_and_leave_logps_unchanged():
    """WPO's aligned log-prob, log p(y_t) - log sum_v p(v)^2, summed per response from the chunked pass
    equals the same from full [T, V] logits: fp32, within K_FORWARD eps of the sums' largest |value| (sums of ~40
    tokens reach ~600 nats, whose fp32 spacing is 6e-5); the log-prob sums are those of the plain pass."""
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
        out = response_logps(hidden[None], batch, f, chunk_size=chunk, stat=wpo_aligned_logps)
        assert_within(out.stat_sums, expected, expected.abs().max().item(), k=K_FORWARD, what=f"chunk {chunk} wpo")
        assert not out.stat_sums.requires_grad  # TRL's weights carry no gradient
        assert_within(out.sums.detach(), plain.sums.detach(), plain.sums.abs().max().item(), k=K_FORWARD,
                      what=f"chunk {chunk} sums")
        assert out.sums.requires_grad
    assert plain.stat_sums is None
    # sum_v p^2 <= max_v p, so the aligned log-prob is not the log-prob itself
    assert (expected - plain.sums.detach()).abs().min() > 1e-3


def test_positions_in_response_and_ld_split_by_hand():
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
