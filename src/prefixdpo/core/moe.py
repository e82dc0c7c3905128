"""Mixture-of-Experts load balancing as TRL 1.16 computes it, on prefix-shared rows and on tree lines: the router
logits of every MoE layer, recorded during our forward, and each token weighted by how many of TRL's padded rows
hold it."""

from __future__ import annotations

import contextlib

import torch

from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.core.model_checks import base_model, text_config, unwrap
from prefixdpo.data.batch import Batch
from prefixdpo.data.lines import sequence_counts


def resolve_router_aux_loss_coef(model, coef: float | None) -> float:
    """TRL 1.16's MoE load-balancing coefficient: `coef`, or the model's own `router_aux_loss_coef` when
    None (0.0 if it declares none); 0.0 for a model that returns no router logits. A coefficient set
    for such a model is refused, as TRL refuses it."""
    hf = unwrap(model)
    cfg = text_config(base_model(model))
    moe = hasattr(cfg, "output_router_logits")
    if coef and not moe:
        raise UnsupportedModelError(
            f"router_aux_loss_coef is set to {coef} but {type(hf).__name__} is not a Mixture-of-Experts model "
            "that returns its router logits, so there is no auxiliary loss to weight"
        )
    if not moe:
        return 0.0
    return float(getattr(cfg, "router_aux_loss_coef", 0.0) if coef is None else coef)


@contextlib.contextmanager
def recording_router_logits(model):
    """Collect each MoE layer's router logits `[tokens, experts]` during a forward, into the yielded list.

    Hooks on the router modules transformers itself records `router_logits` from (the decoder's
    `_can_record_outputs`): asking the model for `output_router_logits` instead would make it compute its
    aux loss with our 4D attention mask, which `load_balancing_loss_func` reads as a `[B, L]` padding mask.
    """
    hf = unwrap(model)
    decoder = hf.get_decoder()
    recorder = (getattr(decoder, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    index = getattr(recorder, "index", 0)
    if not isinstance(target, type):
        raise UnsupportedModelError(f"{type(hf).__name__} does not expose its MoE router logits to transformers")
    captured: list[torch.Tensor] = []

    def grab(_module, _inputs, output):
        captured.append(output[index] if isinstance(output, (tuple, list)) else output)

    handles = [m.register_forward_hook(grab) for m in decoder.modules() if isinstance(m, target)]
    if not handles:
        raise UnsupportedModelError(f"{type(hf).__name__} has no {target.__name__} router modules")
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def trl_token_multiplicity(batch: Batch) -> torch.Tensor:
    """How many times TRL 1.16's paired rows hold each token of `batch`. -> [B, L] fp32 (0 = padding).

    TRL runs each pair as `[prompt][better]` and `[prompt][worse]`: response r's sequence once per pair it is in,
    so a token weighs the pairs of every response whose sequence passes through it (`lines.sequence_counts`; a
    prompt with its responses: 2 per pair for a prompt token, one per pair for a response token). With these
    weights, the load-balancing loss of shared lines equals TRL's on its padded rows: a token's router logits are
    the same in every TRL row that holds it (causal), and each response's are those of its separate sequence.
    """
    in_pairs = torch.bincount(torch.cat([batch.pair_better, batch.pair_worse]), minlength=batch.num_responses).float()
    return sequence_counts(batch, in_pairs)


def router_aux_loss(model, router_logits: list[torch.Tensor], batch: Batch) -> torch.Tensor:
    """TRL 1.16's MoE load-balancing loss (transformers' Mixtral `load_balancing_loss_func`, which TRL
    uses for every MoE family) over the tokens of TRL's padded rows of `batch`'s pairs. -> scalar."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = text_config(base_model(model))
    # configs name their experts two ways (Granite 4 hybrid: num_local_experts only); the MoE families' own copies
    # of the function (gpt-oss, Granite 4 hybrid, Qwen3-Next: what TRL's DPO takes from the model) are Mixtral's
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    return load_balancing_loss_func(tuple(router_logits), experts, cfg.num_experts_per_tok,
                                    trl_token_multiplicity(batch))
