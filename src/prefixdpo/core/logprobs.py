"""Per-response log-probs from final hidden states: the LM head only where a response token is
predicted, in chunks, fp32 log-softmax.

Memory: with grad, each chunk runs under activation checkpointing, so autograd keeps only the chunk's
hidden states; its `[chunk x vocab]` logits are rebuilt one chunk at a time in backward. The largest
tensor ever alive is `[chunk_size x vocab]`, never `[tokens x vocab]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from prefixdpo.data.batch import Batch
from prefixdpo.errors import ConfigError, UserError

Head = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, D] -> logits [N, V] (fp32 or fp64)


class UnsupportedModelError(UserError):
    """The model has a feature prefix sharing cannot reproduce exactly; the message names it."""


def lm_head_fn(model) -> Head:
    """The model's own head path from final hidden states to logits, in fp32.

    Reproduces the logit post-processing some models apply after `lm_head` (granite's
    `logits_scaling`, cohere's `logit_scale`, gemma's `final_logit_softcapping`). Any other head is
    caught by `check_head` comparing against the model's own logits.
    """
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no output embeddings (LM head)")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scale_div = getattr(cfg, "logits_scaling", None)
    scale_mul = getattr(cfg, "logit_scale", None)
    softcap = getattr(cfg, "final_logit_softcapping", None)

    def apply(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden)
        if logits.dtype in (torch.float16, torch.bfloat16):  # at least fp32 for the log-softmax
            logits = logits.float()
        if scale_div is not None:
            logits = logits / scale_div
        if scale_mul is not None:
            logits = logits * scale_mul
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return apply


def check_head(head: Head, hidden: torch.Tensor, model_logits: torch.Tensor, *, atol: float = 1e-3) -> None:
    """Refuse the model if our head path differs from its own logits at the same positions.

    hidden: [N, D] final hidden states; model_logits: [N, V] the model's logits there.
    """
    with torch.no_grad():
        ours = head(hidden.detach())
        diff = (ours - model_logits.detach().float()).abs().max().item()
    scale = max(1.0, model_logits.detach().float().abs().max().item())
    if not diff <= atol * scale:  # also catches NaN
        raise UnsupportedModelError(
            f"the model's LM head applies post-processing prefixdpo does not reproduce "
            f"(logits differ by {diff:.3g}); this architecture is not supported"
        )


def _chunk_token_logps(head: Head, hidden: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """hidden [c, D], target_ids [c] -> log p(target) [c] in fp32."""
    logits = head(hidden)
    return logits.gather(1, target_ids[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _chunk_token_logps_wpo(head: Head, hidden: torch.Tensor, target_ids: torch.Tensor):
    """hidden [c, D], target_ids [c] -> (log p(target) [c], WPO's aligned log-prob [c], no grad).

    WPO's aligned log-prob (https://arxiv.org/abs/2406.11827 eq. 2, as TRL 1.16 computes it) is
    ``log p(y_t) - log sum_v p(v)^2``, from the same logits as the log-prob: no second head pass.
    """
    logits = head(hidden)
    log_z = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(1, target_ids[:, None]).squeeze(1) - log_z
    with torch.no_grad():  # TRL's weights carry no gradient
        log_sum_sq_probs = torch.logsumexp(2 * logits, dim=-1) - 2 * log_z
        aligned = logps - log_sum_sq_probs
    return logps, aligned


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ConfigError(f"chunk_size (logprob_chunk_size) must be >= 1, got {chunk_size}")


def token_logps(head: Head, hidden: torch.Tensor, target_ids: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Log-prob of each target token. hidden [T, D], target_ids [T] -> [T] fp32."""
    return _chunked(_chunk_token_logps, head, hidden, target_ids, chunk_size)


def token_logps_wpo(head: Head, hidden: torch.Tensor, target_ids: torch.Tensor,
                    chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob [T] fp32 of each target token and its WPO aligned log-prob [T] (detached), one head pass."""
    return _chunked(_chunk_token_logps_wpo, head, hidden, target_ids, chunk_size)


def _chunked(fn, head: Head, hidden: torch.Tensor, target_ids: torch.Tensor, chunk_size: int):
    """Apply a chunk function over [T] in chunks (checkpointed under grad); concatenate its output(s)."""
    _check_chunk_size(chunk_size)
    outs = []
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start:start + chunk_size]
        ids = target_ids[start:start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(checkpoint(fn, head, h, ids, use_reentrant=False))
        else:
            outs.append(fn(head, h, ids))
    if not outs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return (empty, empty.clone()) if fn is _chunk_token_logps_wpo else empty
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


@dataclass
class ResponseLogps:
    """Per-response sums over tokens, and the per-token log-probs they were summed from.

    sums:       [R] fp32 log-prob sums; counts: [R] long (tokens per response);
    per_token:  [T] fp32 log-prob of each target token (in `batch.target_*` order; LD-DPO's split needs it);
    wpo_sums:   [R] fp32 sums of WPO's aligned log-probs (detached), only when asked for, else None;
    aux_loss:   scalar MoE load-balancing loss of the forward that produced them, only when asked for.
    """

    sums: torch.Tensor
    counts: torch.Tensor
    per_token: torch.Tensor | None = None
    wpo_sums: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def response_logps(hidden: torch.Tensor, batch: Batch, head: Head, chunk_size: int = 1024, *,
                   wpo: bool = False) -> ResponseLogps:
    """Sum the log-probs of each response's tokens (and, if `wpo`, WPO's aligned log-probs, same pass).

    hidden: [B, L, D] final hidden states of the lines in `batch`.
    """
    predictors = hidden[batch.target_line, batch.target_col]  # [T, D]: only positions that predict a target
    aligned = None
    if wpo:
        per_token, aligned = token_logps_wpo(head, predictors, batch.target_ids, chunk_size)
    else:
        per_token = token_logps(head, predictors, batch.target_ids, chunk_size)
    R = batch.num_responses

    def per_response(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(R, dtype=values.dtype, device=values.device).index_add(0, batch.target_response, values)

    counts = torch.bincount(batch.target_response, minlength=R)
    return ResponseLogps(sums=per_response(per_token), counts=counts, per_token=per_token,
                         wpo_sums=None if aligned is None else per_response(aligned))


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
    """LD-DPO's length-desensitised log-probs of each pair's two responses (https://arxiv.org/abs/2409.06411).

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
