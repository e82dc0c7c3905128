"""Per-response log-probs from final hidden states: the LM head only where a response token is
predicted, in chunks, fp32 log-softmax.

Memory: with grad, autograd keeps only each chunk's hidden states (and, for a plain linear head, each token's
logsumexp); its `[chunk x vocab]` logits are rebuilt one chunk at a time in backward. The largest
tensor ever alive is `[chunk_size x vocab]`, never `[tokens x vocab]`. A head that is one plain `nn.Linear`
(`LinearHead`: most models, tied or not) runs as one autograd function whose backward rebuilds only the logits
and writes the log-softmax gradient in place (`_LinearHeadLogps`); any other head runs under activation
checkpointing, which rebuilds the whole chunk (logits, logsumexp, gather). Both give the same numbers to the bit:
the function's backward is autograd's own sequence of operations. A caller may ask for one more per-token
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


def _scaled_logits(z: torch.Tensor, scale_div, scale_mul) -> torch.Tensor:
    """The head's raw output [c, V] to fp32 logits: at least fp32 for the log-softmax, then the model's scales."""
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()
    if scale_div is not None:
        z = z / scale_div
    if scale_mul is not None:
        z = z * scale_mul
    return z


@dataclass(frozen=True)
class LinearHead:
    """A head that is one plain `nn.Linear` and the model's scale factors: its log-probs can run as one autograd
    function (`_LinearHeadLogps`). weight [V, D]; bias [V] or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scale_div: float | None
    scale_mul: float | None


class ModelHead:
    """The model's own head path from final hidden states to logits, in fp32: `head(hidden [N, D]) -> [N, V]`.
    `linear`: the same head as a `LinearHead` where it is one (else None)."""

    def __init__(self, module: torch.nn.Module, scale_div, scale_mul, softcap):
        self.module, self.scale_div, self.scale_mul, self.softcap = module, scale_div, scale_mul, softcap
        self.linear = _as_linear_head(module, scale_div, scale_mul) if softcap is None else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = _scaled_logits(self.module(hidden), self.scale_div, self.scale_mul)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _as_linear_head(module: torch.nn.Module, scale_div, scale_mul) -> LinearHead | None:
    """A `LinearHead` for a plain `nn.Linear` that nothing hooks; None for anything else. An engine or adapter that
    acts at the head's call (FSDP2's per-module classes, ZeRO-3's gather hooks, accelerate's offload hooks, a LoRA
    layer) must see the call, so such a head keeps the module call under checkpointing."""
    hooked = module._forward_pre_hooks or module._forward_hooks or hasattr(module, "_hf_hook")
    if type(module) is not torch.nn.Linear or hooked or type(module.weight) is not torch.nn.Parameter:
        return None
    return LinearHead(module.weight, module.bias, scale_div, scale_mul)


def lm_head_fn(model) -> ModelHead:
    """The model's own head path from final hidden states to logits, in fp32 (`ModelHead`).

    Reproduces the logit post-processing some models apply after `lm_head` (granite's
    `logits_scaling`, cohere's `logit_scale`, gemma's `final_logit_softcapping`). Any other head is
    caught by `check_head` comparing against the model's own logits.
    """
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no output embeddings (LM head)")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return ModelHead(head, getattr(cfg, "logits_scaling", None), getattr(cfg, "logit_scale", None),
                     getattr(cfg, "final_logit_softcapping", None))


def check_head(head: Head, hidden: torch.Tensor, model_logits: torch.Tensor, *, atol: float = 1e-3) -> None:
    """Refuse the model if our head path differs from its own logits at the same positions.

    hidden: [N, D] final hidden states; model_logits: [N, V] the model's logits there.
    The bound is `atol` relative to the logits' scale, or 4 roundings of the model's logits dtype where that is
    coarser: a bfloat16 model's own logits are rounded to 2^-8 before its soft-capping (Gemma-2's tanh, measured on
    an H200: 0.0146 off our fp32 head), while a post-processing we miss (a cap, a scale) is off by whole units.
    """
    with torch.no_grad():
        ours = head(hidden.detach())
        diff = (ours - model_logits.detach().float()).abs().max().item()
    scale = max(1.0, model_logits.detach().float().abs().max().item())
    rounding = torch.finfo(model_logits.dtype).eps if model_logits.is_floating_point() else 0.0
    if not diff <= max(atol, 4 * rounding) * scale:  # also catches NaN
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


def logsumexp_in_place(logits: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(logits, -1) [c] of logits [c, V], computed in the logits' own storage, which it overwrites.

    The operations of torch's own logsumexp in its order (the row maxima, infinite ones taken as 0, exp of the
    differences, their sum, log, plus the maxima), so the same numbers to the bit; but the differences are written
    over the logits instead of a fresh [c, V] tensor: on CPU each fresh buffer of a large vocabulary (200 MB per
    1024-token chunk of a 49k vocabulary) costs its page faults, 4% of a SmolLM2 DPO step (profiled, issue 29)."""
    maxes = logits.amax(-1, keepdim=True)
    maxes.masked_fill_(maxes.abs() == float("inf"), 0)
    return logits.sub_(maxes).exp_().sum(-1).log_().add_(maxes.squeeze(-1))


class _LinearHeadLogps(torch.autograd.Function):
    """log p(target) [c] of a `LinearHead` on hidden [c, D], keeping only hidden and each row's logsumexp [c] for
    backward. Backward rebuilds the logits once and runs autograd's own operations on them, in place where autograd
    allocates: d/dlogits = -g exp(logits - log_z), plus g at each target (what LogsumexpBackward and GatherBackward
    sum to), through the scales, then the linear layer's two matmuls. Checkpointing the generic chunk instead
    recomputes the logsumexp and the gather too and allocates three more [c, V] tensors in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, scale_div, scale_mul):
        logits = _scaled_logits(torch.nn.functional.linear(hidden, weight, bias), scale_div, scale_mul)
        picked = logits.gather(1, target_ids[:, None]).squeeze(1)
        log_z = logsumexp_in_place(logits)  # logits are spent after this
        ctx.save_for_backward(hidden, weight, bias, target_ids, log_z)
        ctx.scales = (scale_div, scale_mul)
        return picked - log_z

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, target_ids, log_z = ctx.saved_tensors
        scale_div, scale_mul = ctx.scales
        z = _scaled_logits(torch.nn.functional.linear(hidden, weight, bias), scale_div, scale_mul)
        z.sub_(log_z[:, None]).exp_().mul_(-grad[:, None])  # the logsumexp's share
        z.scatter_add_(1, target_ids[:, None], grad[:, None])  # the gather's share
        if scale_mul is not None:
            z = z * scale_mul
        if scale_div is not None:
            z = z / scale_div
        z = z.to(weight.dtype)
        grad_hidden = z.mm(weight) if ctx.needs_input_grad[0] else None
        grad_weight = hidden.t().mm(z).t() if ctx.needs_input_grad[1] else None  # as addmm's backward: [D, V]^T
        grad_bias = z.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _linear_chunk_logps(head: LinearHead, hidden: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    return _LinearHeadLogps.apply(hidden, head.weight, head.bias, target_ids, head.scale_div, head.scale_mul)


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ConfigError(f"chunk_size (logprob_chunk_size) must be >= 1, got {chunk_size}")


def token_logps(head: Head, hidden: torch.Tensor, target_ids: torch.Tensor, chunk_size: int = 1024, *,
                stat: TokenStat | None = None, min_tokens: int = 0):
    """Log-prob of each target token, hidden [T, D], target_ids [T] -> [T] fp32; with `stat`, ([T], stat's [T]).

    In chunks of `chunk_size` tokens: a `ModelHead` with a `linear` form as `_LinearHeadLogps`, any other head
    checkpointed under grad (the module docstring); as many chunks as `min_tokens` tokens would need at least (the
    trailing ones empty): sequence-parallel ranks holding different numbers of targets call the head equally often
    (an engine that gathers its weight at each call needs that)."""
    _check_chunk_size(chunk_size)
    linear = getattr(head, "linear", None) if stat is None else None
    if torch.is_autocast_enabled(hidden.device.type):  # autograd's backward would recompute outside autocast
        linear = None
    outs = []
    for start in range(0, max(hidden.shape[0], min_tokens), chunk_size):
        h = hidden[start:start + chunk_size]
        ids = target_ids[start:start + chunk_size]
        if linear is not None:
            outs.append(_linear_chunk_logps(linear, h, ids))
        elif torch.is_grad_enabled() and h.requires_grad:
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
                   stat: TokenStat | None = None) -> ResponseLogps:
    """Sum the log-probs of each response's tokens (and, with `stat`, that statistic, from the same head pass).

    hidden: [B, L, D] final hidden states of the lines in `batch`."""
    per_token, stats = _target_logps(head, hidden, batch.target_line, batch.target_col, batch.target_ids,
                                     chunk_size, stat)
    return response_sums(per_token, stats, batch)


def response_sums(per_token: torch.Tensor, stats: torch.Tensor | None, batch: Batch) -> ResponseLogps:
    """`ResponseLogps` of `batch` from each target's log-prob [T] (and statistic [T] or None), in `batch.target_*`
    order."""
    R = batch.num_responses

    def per_response(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(R, dtype=values.dtype, device=values.device).index_add(0, batch.target_response, values)

    counts = torch.bincount(batch.target_response, minlength=R)
    return ResponseLogps(sums=per_response(per_token), counts=counts, per_token=per_token,
                         stat_sums=None if stats is None else per_response(stats))
