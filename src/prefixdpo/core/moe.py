"""Mixture-of-Experts load balancing as TRL 1.16 computes it, on prefix-shared rows and on tree lines: the router
logits of every MoE layer, recorded during our forward, and each token weighted by how many of TRL's padded rows
hold it."""

from __future__ import annotations

import contextlib

import torch

from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.core.model_checks import base_model, text_config, unwrap
from prefixdpo.data.batch import Batch


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

    TRL runs each pair as `[prompt][better]` and `[prompt][worse]`: a prompt token counts twice per pair
    of its example, a response token once per pair it is in. With these weights, the load-balancing loss
    of a prefix-shared row equals TRL's on its padded rows: a prompt's router logits are the same in
    both of TRL's rows (causal), and each response's are those of its separate sequence (the mask rule).
    Each response's line, document and branch are the batch's own record of them (`Batch.response_line` ...).
    Tree lines: `_tree_multiplicity`.
    """
    in_pairs = torch.bincount(torch.cat([batch.pair_better, batch.pair_worse]), minlength=batch.num_responses).float()
    if batch.is_tree:
        return _tree_multiplicity(batch, in_pairs)
    B, device = batch.input_ids.shape[0], batch.input_ids.device
    docs = int(batch.doc_ids.max()) + 1 if batch.doc_ids.numel() else 1
    example = batch.response_line * docs + batch.response_doc  # [R]: (line, document) of each response as one number
    pairs_of_example = torch.bincount(example[batch.pair_better], minlength=B * docs).float()
    table = torch.zeros(B * docs, int(batch.branch_ids.max()) + 1, device=device)
    table[:, 0] = 2 * pairs_of_example
    table[example, batch.response_branch] = in_pairs
    real = batch.doc_ids >= 0
    rows = torch.arange(B, device=device)[:, None] * docs + batch.doc_ids.clamp(min=0)
    return torch.where(real, table[rows, batch.branch_ids.clamp(min=0)], 0.0)


def _tree_multiplicity(batch: Batch, in_pairs: torch.Tensor) -> torch.Tensor:
    """`trl_token_multiplicity` of tree lines; in_pairs [R]: the pairs each response is in. -> [B, L] fp32.

    A node is computed once but lies on every sequence through it, and TRL runs response r's sequence once per
    pair r is in: its weight is the sum of in_pairs[r] over the sequences through it, i.e. over the responses whose
    last token (`Batch.response_last`) its span [tin, tout) holds. (A prompt with its responses: 2 per pair, as
    above.) Each response's count sits at its last token's column; a node sums the counts in its span, by a
    prefix sum along the line.
    """
    B, L = batch.input_ids.shape
    counts = torch.zeros(B, L + 1, device=in_pairs.device)  # counts[b, c + 1]: the sequences ending at column c
    counts.index_put_((batch.response_line, batch.response_last + 1), in_pairs, accumulate=True)
    before = counts.cumsum(dim=1)  # [B, L + 1]: before[b, c] = the counts at columns < c
    tin, tout = batch.tree_spans[..., 0], batch.tree_spans[..., 1]
    real = tin >= 0
    weight = before.gather(1, tout.clamp(min=0)) - before.gather(1, tin.clamp(min=0))
    return torch.where(real, weight, 0.0)


def router_aux_loss(model, router_logits: list[torch.Tensor], batch: Batch) -> torch.Tensor:
    """TRL 1.16's MoE load-balancing loss (transformers' Mixtral `load_balancing_loss_func`, which TRL
    uses for every MoE family) over the tokens of TRL's padded rows of `batch`'s pairs. -> scalar."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf = unwrap(model)
    cfg = text_config(base_model(model))
    return load_balancing_loss_func(tuple(router_logits), cfg.num_experts, cfg.num_experts_per_tok,
                                    trl_token_multiplicity(batch))
