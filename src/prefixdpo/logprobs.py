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


def token_logps(head: Head, hidden: torch.Tensor, target_ids: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Log-prob of each target token. hidden [T, D], target_ids [T] -> [T] fp32."""
    if chunk_size < 1:
        raise ConfigError(f"chunk_size (logprob_chunk_size) must be >= 1, got {chunk_size}")
    outs = []
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start:start + chunk_size]
        ids = target_ids[start:start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(checkpoint(_chunk_token_logps, head, h, ids, use_reentrant=False))
        else:
            outs.append(_chunk_token_logps(head, h, ids))
    if not outs:
        return hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(outs)


@dataclass
class ResponseLogps:
    """Per-response sums over tokens. sums: [R] fp32; counts: [R] long (tokens per response)."""

    sums: torch.Tensor
    counts: torch.Tensor


def response_logps(hidden: torch.Tensor, batch: Batch, head: Head, chunk_size: int = 1024) -> ResponseLogps:
    """Sum the log-probs of each response's tokens.

    hidden: [B, L, D] final hidden states of the lines in `batch`.
    """
    predictors = hidden[batch.target_line, batch.target_col]  # [T, D]: only positions that predict a target
    per_token = token_logps(head, predictors, batch.target_ids, chunk_size)
    R = batch.num_responses
    sums = torch.zeros(R, dtype=per_token.dtype, device=per_token.device).index_add(0, batch.target_response, per_token)
    counts = torch.bincount(batch.target_response, minlength=R)
    return ResponseLogps(sums=sums, counts=counts)
