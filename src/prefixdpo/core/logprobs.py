"""Per-response log-probs from final hidden states: the LM head only where a response token is
predicted, in chunks, fp32 log-softmax.

Memory: with grad, each chunk runs under activation checkpointing, so autograd keeps only the chunk's
hidden states; its `[chunk x vocab]` logits are rebuilt one chunk at a time in backward. The largest
tensor ever alive is `[chunk_size x vocab]`, never `[tokens x vocab]`. A caller may ask for one more per-token
statistic of the same logits (`TokenStat`), summed per response beside the log-probs: core knows no method that
asks (e.g. WPO's weights, in `prefixdpo.dpo.token_weights`).
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


TokenStat = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""A per-token statistic a training method asks of the head pass, from the chunk's own logits:
``stat(logits [c, V], log_z [c], logps [c]) -> [c]`` (log_z: each row's logsumexp; logps: log p(target)). Core
sums it per response (`ResponseLogps.stat_sums`); it carries whatever gradient the method gives it."""


def _chunk_token_logps(head: Head, hidden: torch.Tensor, target_ids: torch.Tensor, stat: TokenStat | None = None):
    """hidden [c, D], target_ids [c] -> log p(target) [c] in fp32, and `stat` of the same logits [c] if asked
    (no second head pass)."""
    logits = head(hidden)
    log_z = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(1, target_ids[:, None]).squeeze(1) - log_z
    return logps if stat is None else (logps, stat(logits, log_z, logps))


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ConfigError(f"chunk_size (logprob_chunk_size) must be >= 1, got {chunk_size}")


def token_logps(head: Head, hidden: torch.Tensor, target_ids: torch.Tensor, chunk_size: int = 1024, *,
                stat: TokenStat | None = None, min_tokens: int = 0):
    """Log-prob of each target token, hidden [T, D], target_ids [T] -> [T] fp32; with `stat`, ([T], stat's [T]).

    In chunks of `chunk_size` tokens, each checkpointed under grad (the module docstring); as many chunks as
    `min_tokens` tokens would need at least (the trailing ones empty): sequence-parallel ranks holding different
    numbers of targets call the head equally often (an engine that gathers its weight at each call needs that)."""
    _check_chunk_size(chunk_size)
    outs = []
    for start in range(0, max(hidden.shape[0], min_tokens), chunk_size):
        h = hidden[start:start + chunk_size]
        ids = target_ids[start:start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(checkpoint(_chunk_token_logps, head, h, ids, stat, use_reentrant=False))
        else:
            outs.append(_chunk_token_logps(head, h, ids, stat))
    if not outs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty if stat is None else (empty, empty.clone())
    if stat is None:
        return torch.cat(outs)
    return tuple(torch.cat(parts) for parts in zip(*outs))


def _target_logps(head: Head, hidden, lines, columns, target_ids, chunk_size: int, stat: TokenStat | None,
                  min_tokens: int = 0):
    """(log p [t], stat [t] or None) of the targets predicted at hidden[lines, columns] (hidden [B, L, D])."""
    predictors = hidden[lines, columns]  # [t, D]: only positions that predict a target
    if stat is None:
        return token_logps(head, predictors, target_ids, chunk_size, min_tokens=min_tokens), None
    return token_logps(head, predictors, target_ids, chunk_size, stat=stat, min_tokens=min_tokens)


@dataclass
class ResponseLogps:
    """Per-response sums over tokens, and the per-token log-probs they were summed from.

    sums:       [R] fp32 log-prob sums; counts: [R] long (tokens per response);
    per_token:  [T] fp32 log-prob of each target token (in `batch.target_*` order; e.g. for a per-token split);
    stat_sums:  [R] fp32 sums of the asked-for per-token statistic (`TokenStat`), only when asked for, else None;
    aux_loss:   scalar MoE load-balancing loss of the forward that produced them, only when asked for.
    """

    sums: torch.Tensor
    counts: torch.Tensor
    per_token: torch.Tensor | None = None
    stat_sums: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def response_logps(hidden: torch.Tensor, batch: Batch, head: Head, chunk_size: int = 1024, *,
                   stat: TokenStat | None = None, sp=None) -> ResponseLogps:
    """Sum the log-probs of each response's tokens (and, with `stat`, that statistic, from the same head pass).

    hidden: [B, L, D] final hidden states of the lines in `batch`; with `sp` (a `sequence_parallel.SequenceParallel`)
    [B, L / N, D], this rank's columns: the head runs on the targets predicted there, and every rank gets all [T].
    """
    if sp is None:
        per_token, stats = _target_logps(head, hidden, batch.target_line, batch.target_col, batch.target_ids,
                                         chunk_size, stat)
    else:
        length = batch.input_ids.shape[1]
        mine, local_cols = sp.owned(batch.target_col, length)
        per_token, stats = _target_logps(head, hidden, batch.target_line[mine], local_cols, batch.target_ids[mine],
                                         chunk_size, stat, min_tokens=sp.most_owned(batch.target_col, length))
        per_token = sp.gathered(per_token, mine)
        stats = None if stats is None else sp.gathered(stats, mine)
    R = batch.num_responses

    def per_response(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(R, dtype=values.dtype, device=values.device).index_add(0, batch.target_response, values)

    counts = torch.bincount(batch.target_response, minlength=R)
    return ResponseLogps(sums=per_response(per_token), counts=counts, per_token=per_token,
                         stat_sums=None if stats is None else per_response(stats))
