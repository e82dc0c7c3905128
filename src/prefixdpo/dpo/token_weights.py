"""TRL's two DPO options that weigh a response's log-probs token by token, as TRL 1.16 computes them.

- WPO (`use_weighting`, https://arxiv.org/abs/2406.11827): each pair's losses times the product of its two
  responses' weights, a response's weight being exp(mean over its tokens of the aligned log-prob
  ``log p(y_t) - log sum_v p(v)^2``). The aligned log-prob is a per-token statistic of the policy's own head
  pass (`wpo_aligned_logps`, a `core.logprobs.TokenStat`), summed per response by core.
- LD-DPO (`ld_alpha`, https://arxiv.org/abs/2409.06411): within a pair, the tokens of the longer response past
  the shorter one's length count with weight alpha (`ld_pair_logps`), from the per-token log-probs core keeps.
"""

from __future__ import annotations

import torch

__all__ = ["wpo_aligned_logps", "wpo_pair_weights", "positions_in_response", "ld_pair_logps"]


def wpo_aligned_logps(logits: torch.Tensor, log_z: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """WPO's aligned log-prob of each token of a chunk, without gradient (TRL's weights carry none).

    logits [c, V] fp32, log_z [c] (each row's logsumexp), logps [c] log p(target) -> [c]:
    ``log p(y_t) - log sum_v p(v)^2`` (eq. 2), from the same logits as the log-prob: no second head pass.
    """
    with torch.no_grad():
        log_sum_sq_probs = torch.logsumexp(2 * logits, dim=-1) - 2 * log_z
        return logps - log_sum_sq_probs


def wpo_pair_weights(aligned_sums: torch.Tensor, counts: torch.Tensor, better: torch.Tensor,
                     worse: torch.Tensor) -> torch.Tensor:
    """Each pair's WPO weight [P]: ``w_better * w_worse``, w = exp(mean aligned log-prob over the response's
    tokens, at least one token), as TRL. aligned_sums [R] (detached), counts [R], better/worse [P]."""
    response_weights = torch.exp(aligned_sums / counts.to(aligned_sums.dtype).clamp(min=1))
    return response_weights[better] * response_weights[worse]


def positions_in_response(target_response: torch.Tensor, num_responses: int) -> torch.Tensor:
    """0-based position of each target token within its response. target_response [T] -> [T] long.

    A response's tokens appear in `target_*` order as they appear in the response (the layout writes
    them left to right), so the position is the running count of earlier targets of the same response.
    """
    T = target_response.numel()
    order = torch.sort(target_response, stable=True).indices  # groups each response's tokens, order kept
    grouped = target_response[order]
    starts = torch.zeros(num_responses + 1, dtype=torch.long, device=target_response.device)
    starts[1:] = torch.cumsum(torch.bincount(target_response, minlength=num_responses), 0)
    rank = torch.arange(T, device=target_response.device) - starts[grouped]
    return torch.empty_like(rank).index_copy_(0, order, rank)


def ld_pair_logps(per_token: torch.Tensor, target_response: torch.Tensor, counts: torch.Tensor,
                  better: torch.Tensor, worse: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LD-DPO's length-desensitised log-probs of each pair's two responses.

    Within pair p, the first ``min(len_better, len_worse)`` tokens of each response (the public part)
    count fully and the rest (the longer response's verbose tail) is weighted by ``alpha``, exactly as
    TRL 1.16's ``ld_alpha``. A response in several pairs gets each pair's own split.

    per_token [T], target_response [T], counts [R], better/worse [P] -> ([P], [P]).
    """
    R = counts.numel()
    pos = positions_in_response(target_response, R)
    # one row per response, its tokens in order: [R, longest response]
    grid = per_token.new_zeros(R, max(int(counts.max()) if R else 0, 1)).index_put((target_response, pos), per_token)
    shared = torch.minimum(counts[better], counts[worse])  # [P]: the pair's public length
    public = torch.arange(grid.shape[1], device=grid.device)[None, :] < shared[:, None]  # [P, longest]

    def side(resp: torch.Tensor) -> torch.Tensor:
        rows = grid[resp]
        return (rows * public).sum(1) + alpha * (rows * ~public).sum(1)

    return side(better), side(worse)
