"""One call of a causal LM (or reward model) inside the forward of the module its engine wraps.

Everything runs inside the forward of the module the engine wraps (`through_engine`): the model's own forward, a
forward hook on its decoder that captures the final hidden states, and whatever head reads them (`core.one_pass`).
So DDP, FSDP2 (parameters unsharded only between its pre- and post-forward hooks), DeepSpeed ZeRO-3 (parameters
gathered per module call), PEFT and gradient checkpointing all see one normal call, and a head's weight is the full
one.
"""

from __future__ import annotations

from typing import Callable

import torch

from prefixdpo.core.attention.pass_plan import PassPlan
from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.core.model_checks import base_model, takes_position_ids, unwrap
from prefixdpo.core.recurrent import runs_recurrent
from prefixdpo.core.vml_warmup import warm_up as warm_up_vml


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


def model_pass(model, inner_forward, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: PassPlan,
               **model_inputs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | float]:
    """One model call over `plan` (inside `through_engine`; no KV cache): (the decoder's final hidden states
    [B, L, D], captured by a hook; the model's own logits at the last position [B, V] or None; `zero_path`).

    The plan reaches the attention calls as the `pass_plan` keyword; the model's `attention_mask` is the plan's
    zero-size stand-in (`PassPlan.model_mask`)."""
    captured: list[torch.Tensor] = []

    def grab(_module, _inputs, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = unwrap(model).get_decoder().register_forward_hook(grab)
    try:
        # a forward without position_ids (a pure state-space model: nothing positional) is handed none, as TRL does
        positions = {"position_ids": position_ids} if takes_position_ids(model) else {}
        out = inner_forward(use_cache=False, input_ids=input_ids, **positions,
                            attention_mask=plan.model_mask(tensor_only=runs_recurrent(base_model(model))),
                            pass_plan=plan, **model_inputs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise UnsupportedModelError(f"expected the decoder to run once, it ran {len(captured)} times")
    logits = out.logits if hasattr(out, "logits") else out[0]
    last = logits[:, -1] if logits is not None and logits.dim() == 3 else None
    return captured[0], last, zero_path(logits)


def zero_path(logits: torch.Tensor | None) -> torch.Tensor | float:
    """Exactly zero, with a path from the model's own output `logits` where they have a graph (else 0.0), to add to
    what a pass returns: FSDP2 crashes in backward (SIGSEGV, torch 2.13 + gloo) when an output of a sharded module
    (here the model's own head call) reaches no loss, and a pass with nothing to score still has a graph to run
    backward through."""
    return logits.sum() * 0.0 if logits is not None and logits.requires_grad else 0.0


__all__ = ["model_pass", "through_engine", "zero_path"]
