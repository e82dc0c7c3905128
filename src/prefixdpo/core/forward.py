"""Run any Hugging Face causal LM on prefix-shared lines and return per-response log-probs.

Everything runs inside the forward of the module the engine wraps (`through_engine`): the model's own
forward, a forward hook on its decoder that captures the final hidden states, and the LM head applied
only where a response token is predicted (`logprobs.py`). So DDP, FSDP2 (parameters unsharded only
between its pre- and post-forward hooks), DeepSpeed ZeRO-3 (parameters gathered per module call),
PEFT and gradient checkpointing all see one normal call, and the head's weight is the full one.
`logits_to_keep=1` keeps the model's own head to one position per line; that position doubles as a
check that our head path equals the model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import torch

from prefixdpo.core.logprobs import (
    ResponseLogps, TokenStat, UnsupportedModelError, check_head, lm_head_fn, response_logps,
)
from prefixdpo.core.model_checks import check_sequences_fit_window, text_config, unwrap
from prefixdpo.core.moe import recording_router_logits, router_aux_loss
from prefixdpo.core import sequence_parallel
from prefixdpo.core.attention.reuse_plan import PrefixReuse
from prefixdpo.core.prefix_reuse import reused_hidden_states
from prefixdpo.core.vml_warmup import warm_up as warm_up_vml
from prefixdpo.data.batch import Batch
from prefixdpo.errors import ConfigError

def through_engine(model, body: Callable[..., dict], **inputs) -> dict:
    """Call `model` (bare, or wrapped by DDP / FSDP2 / DeepSpeed) with `inputs`, running `body` as the
    forward of the module the engine wraps: ``body(inner_forward, **inputs)``, where `inner_forward` is
    that module's own forward (accelerate's mixed-precision wrapper included, if any).

    body returns a dict of tensors: the engines find a forward's output tensors by walking dicts (DDP's
    unused-parameter search, FSDP2's pre-backward hooks), not arbitrary objects.
    """
    warm_up_vml()  # before this process's first forward (prefixdpo.core.vml_warmup); once per process
    inner = unwrap(model)
    own = inner.__dict__.get("forward")  # an instance-level forward (accelerate's autocast wrapper) stays in use
    inner_forward = own if own is not None else inner.forward

    def forward(*args, **kwargs):
        if args:
            raise TypeError("prefixdpo passes every model input by keyword")
        return body(inner_forward, **kwargs)

    inner.forward = forward
    try:
        return model(**inputs)
    finally:
        if own is not None:
            inner.forward = own
        else:
            del inner.forward


def decoder_output(model, inner_forward, **inputs):
    """Run `inner_forward` (the forward of `unwrap(model)`, inside `through_engine`) with `inputs` (no KV cache unless
    they ask for one); return (the decoder's final hidden states [B, L, D], captured by a hook, and the model's
    output)."""
    captured: list[torch.Tensor] = []

    def grab(_module, _inputs, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = unwrap(model).get_decoder().register_forward_hook(grab)
    try:
        out = inner_forward(**{"use_cache": False, **inputs})
    finally:
        handle.remove()
    if len(captured) != 1:
        raise UnsupportedModelError(f"expected the decoder to run once, it ran {len(captured)} times")
    return captured[0], out


def pass_hidden_states(model, inner_forward, **inputs):
    """`decoder_output` of one pass over `inputs`, or, where the `attention_mask` is a `PrefixReuse`, the hidden
    states [B, L, D] of the passes it plans (`core.prefix_reuse`; built from `inputs["spans"]`) and no model output."""
    reuse = inputs.pop("attention_mask")
    ids, positions, spans = inputs.pop("input_ids"), inputs.pop("position_ids"), inputs.pop("spans", None)
    if isinstance(reuse, PrefixReuse):
        run = functools.partial(decoder_output, **inputs)  # the model's other inputs, for each of the passes
        return reused_hidden_states(model, inner_forward, ids, positions, spans, reuse, run), None
    return decoder_output(model, inner_forward, input_ids=ids, position_ids=positions, attention_mask=reuse, **inputs)


def final_hidden_states(model, inner_forward, **inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A causal LM's (hidden [B, L, D], its own logits at the last position [B, V] or None), inside
    `through_engine`. An `attention_mask` that is a `PrefixReuse` runs its lines as it plans them (no logits)."""
    # A MoE model asked for router logits computes its aux loss from `attention_mask` read as a [B, L]
    # padding mask, which ours is not: `recording_router_logits` collects them instead.
    moe = {"output_router_logits": False} if hasattr(text_config(unwrap(model)), "output_router_logits") else {}
    # logits_to_keep=1: the model's own head on one position only; we apply ours where needed
    hidden, out = pass_hidden_states(model, inner_forward, logits_to_keep=1, **inputs, **moe)
    if out is None:
        return hidden, None
    logits = out.logits if hasattr(out, "logits") else out[0]
    return hidden, (logits[:, -1] if logits is not None and logits.dim() == 3 else None)


def batch_inputs(batch: Batch, attention_mask) -> dict:
    """The model inputs of a pass over `batch` with `attention_mask` (a mask, or a `PrefixReuse` plan)."""
    inputs = {"input_ids": batch.input_ids, "attention_mask": attention_mask, "position_ids": batch.position_ids}
    if isinstance(attention_mask, PrefixReuse):  # its passes build their own masks from the spans
        inputs["spans"] = batch.spans
    return inputs


def sharded_inputs(sp, inputs: dict) -> dict:
    """`inputs` of a pass over whole lines as this rank runs them under sequence parallelism `sp` (None: unchanged):
    its columns of input_ids and position_ids [B, L / N], and the whole lines' mask carrying `sp` to the attention
    calls (`backends.prefix_attention_forward`)."""
    if sp is None:
        return inputs
    mask = inputs["attention_mask"]
    if isinstance(mask, PrefixReuse) or getattr(mask, "prefix_kv", None) is not None:
        raise ConfigError("prefix_reuse=true is not supported with sequence parallelism yet: set one of them off")
    mask.sequence_parallel = sp
    return {**inputs, "input_ids": sp.shard(inputs["input_ids"]), "position_ids": sp.shard(inputs["position_ids"])}


def compute_response_logps(
    model, batch: Batch, attention_mask, *, chunk_size: int = 1024, stat: TokenStat | None = None,
    router_aux: bool = False,
) -> ResponseLogps:
    """Per-response log-prob sums and token counts for `batch` (grad follows torch.is_grad_enabled()).

    attention_mask: the batch's mask for the run's backend (`backends.batch_attention_mask`), built once per
                    micro-batch by the caller and shared by every pass over it (policy, reference, pre-pass).
    stat: a per-token statistic of the same head pass, summed per response (`ResponseLogps.stat_sums`).
    router_aux: also the MoE load-balancing loss of this pass (`ResponseLogps.aux_loss`, TRL's).
    """
    hf = unwrap(model)
    check_sequences_fit_window(model, batch)
    if router_aux and isinstance(attention_mask, PrefixReuse):
        raise ConfigError("prefix_reuse does not compute the MoE load-balancing loss (its router logits come in "
                          "chunks, not the row's layout): set router_aux_loss_coef 0, or prefix_reuse false")
    sp = sequence_parallel.of(model)
    if sp is not None and router_aux:
        raise ConfigError("sequence parallelism does not compute the MoE load-balancing loss yet: set "
                          "router_aux_loss_coef 0, or sequence_parallel_size 1")

    def body(inner_forward, **inputs) -> dict:
        with recording_router_logits(model) if router_aux else contextlib.nullcontext() as router_logits:
            hidden, model_last_logits = final_hidden_states(model, inner_forward, **inputs)
        head = lm_head_fn(hf)
        if model_last_logits is not None and not getattr(hf, "_prefixdpo_head_checked", False):
            check_head(head, hidden[:, -1], model_last_logits)
            hf._prefixdpo_head_checked = True
        result = response_logps(hidden, batch, head, chunk_size, stat=stat, sp=sp)
        if router_aux:
            result.aux_loss = router_aux_loss(model, router_logits, batch)
        if model_last_logits is not None and model_last_logits.requires_grad:
            # FSDP2 crashes in backward (SIGSEGV, torch 2.13 + gloo) when an output of a sharded module (here the
            # model's own head call) has no path to the loss: give it one, of exactly zero.
            nothing = model_last_logits.sum() * 0.0
            result.sums = result.sums + nothing
            result.per_token = result.per_token + nothing
        return {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if getattr(result, f.name) is not None}

    return ResponseLogps(**through_engine(model, body, **sharded_inputs(sp, batch_inputs(batch, attention_mask))))

