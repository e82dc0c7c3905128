"""Per-token log-probs (and entropies, and the MoE load-balancing loss) of TRL's rows from prefix-shared lines.

The lines (`layout.GroupLines`) run through the one pass (`core.one_pass.run_pass`: DDP, FSDP2, DeepSpeed and
PEFT see one ordinary forward call); inside that forward the decoder's final hidden states are taken at the slots
that predict a scored token only, and TRL's own fused LM-head kernel
(`trl.kernels.ChunkedLogProbFunction`, the one its `add_fused_lm_head` runs, with its temperature, logit
scale, soft-cap and entropy, forward and backward) turns them into log-probs. The results are scattered
back to TRL's `[rows, logits_to_keep]` layout, zero where TRL's are zero (masked columns).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from prefixdpo.core.attention.pass_plan import PassPlan, plan_pass
from prefixdpo.core.forward import causal_lm_inputs
from prefixdpo.core.model_checks import base_model, text_config
from prefixdpo.core.one_pass import Readout, run_pass
from prefixdpo.grpo.layout import GroupLines, aux_token_weights, line_chunks


@dataclass(frozen=True)
class HeadSettings:
    """The constants TRL 1.16's `add_fused_lm_head` closes over for a model (read from its source: the same
    lookups, in the same order). temperature: TRL's sampling temperature, which divides the logits."""

    temperature: float
    cast_to_fp32: bool
    final_logit_softcapping: float | None
    logit_scale: float


def trl_head_settings(model, temperature: float, cast_lm_head_to_fp32: bool = False) -> HeadSettings:
    """`HeadSettings` of `model` (any wrapper: the text config of the transformers model inside)."""
    cfg = text_config(base_model(model))
    scale = getattr(cfg, "logit_scale", None)
    if scale is None:
        scale = getattr(cfg, "output_multiplier", None)
    if scale is None:
        scale = getattr(cfg, "lm_head_multiplier", None)
    if scale is None and getattr(cfg, "logits_scaling", None) is not None:
        scale = cfg.logits_scaling if cfg.model_type == "hyperclovax" else 1 / cfg.logits_scaling
    return HeadSettings(
        temperature=float(temperature),
        cast_to_fp32=bool(cast_lm_head_to_fp32),
        final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None),
        logit_scale=1.0 if scale is None else scale,
    )


def trl_head(hf, hidden: torch.Tensor, targets: torch.Tensor, settings: HeadSettings,
             entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's fused LM head on the given positions only: (log p(target) [T] fp32, entropy [T] fp32 or None).

    hf: the model whose output embeddings are the head (called inside the engine-wrapped forward, where a
    sharded engine has gathered them); hidden: [T, D]; targets: [T] long.
    """
    from torch.distributed.tensor import DTensor
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE, maybe_gather_lm_head_ctx

    lm_head = hf.get_output_embeddings()
    weight, bias = lm_head.weight, lm_head.bias
    hidden = hidden.to(weight.device)
    autocast = contextlib.nullcontext()
    if settings.cast_to_fp32:
        hidden = hidden.float()
        autocast = torch.autocast(hidden.device.type, enabled=False)
    if isinstance(weight, DTensor):  # as TRL: an FSDP2 head kept sharded outside its own forward
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    with autocast, maybe_gather_lm_head_ctx(weight, bias):
        logps, ent, *_ = ChunkedLogProbFunction.apply(
            hidden, weight, bias, targets, settings.temperature, _CHUNKED_LOGPROB_CHUNK_SIZE,
            settings.final_logit_softcapping, settings.logit_scale, outputs,
        )
    return logps, ent


def _lines_readout(model, lines: GroupLines, first_line: int, targets: slice, settings: HeadSettings,
                   entropy: bool, aux: bool) -> Readout:
    """What the pass over the chunk of lines from `first_line` on reads (`one_pass.Readout`): TRL's head at the slots
    predicting its scored tokens `targets` -> logps [t], entropy [t] (if asked), and the router logits (if aux)."""
    hf = base_model(model)
    ids = lines.target_ids[targets]

    def head(hidden: torch.Tensor, mine, min_rows: int) -> dict:
        logps, ent = trl_head(hf, hidden, ids if mine is None else ids[mine], settings, entropy)
        return {"logps": logps} if ent is None else {"logps": logps, "entropy": ent}

    line, column = lines.target_line[targets] - first_line, lines.target_col[targets]
    return Readout(line, column, head, model_inputs=causal_lm_inputs(model), router_logits=aux)


# Padding a segmented-attention group may add at most this share of its real query-key cells (`segments._group`;
# the DPO default is 0.25). A group's segments are one prompt's completions here, of spread lengths: measured on
# the bench's GRPO profiles (CPU, 1 thread, attention forward + backward of a step's lines), 0.1 ran 7-13% faster
# than 0.25 on each of the three (the extra SDPA calls cost less than the padding they drop), 0.0 and 0.05 no
# better than 0.1.
GROUP_SEGMENT_WASTE = 0.1


def _chunk_plan(lines: GroupLines, start: int, end: int, backend: str, tokens_per_pass: int | None = None) -> PassPlan:
    """The pass plan of lines [start, end) for `backend` (prefix reuse's for a line over `tokens_per_pass`), built
    once per layout (`GroupLines.masks`)."""
    key = (start, end, backend, tokens_per_pass)
    if key not in lines.masks:
        lines.masks[key] = plan_pass(lines.spans[start:end], backend, segment_waste=GROUP_SEGMENT_WASTE,
                                     max_tokens_per_pass=tokens_per_pass)
    return lines.masks[key]


def _chunk_targets(lines: GroupLines, start: int, end: int) -> slice:
    """The targets predicted from lines [start, end) (targets are in line order)."""
    lo = int(torch.searchsorted(lines.target_line, torch.tensor(start, device=lines.target_line.device)))
    hi = int(torch.searchsorted(lines.target_line, torch.tensor(end, device=lines.target_line.device)))
    return slice(lo, hi)


def group_logps(
    model,
    lines: GroupLines,
    settings: HeadSettings,
    *,
    backend: str,
    max_slots: int,
    compute_entropy: bool = False,
    aux_row_chunks: list[torch.Tensor] | None = None,
    tokens_per_pass: int | None = None,
    sp=None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """TRL's `(per-token log-probs [N, K], entropies [N, K] or None, MoE aux loss or None)` from the lines.

    backend: a resolved attention backend; max_slots: line slots per forward (`line_chunks`); tokens_per_pass: prefix
    reuse's budget (a line over it runs its prompt once and its completions in chunks, `core.prefix_reuse`), or None.
    aux_row_chunks: TRL's forwards as row-index tensors, when the load-balancing loss is asked for: TRL
    averages it over its forwards, each over its own rows' real tokens (`aux_token_weights`).
    sp: this rank's sequence-parallel group (`core.sequence_parallel`; every rank of it runs these same lines), or
    None.
    """
    aux = aux_row_chunks is not None
    logps, entropies, router = [], [], []
    for start, end in line_chunks(lines, max_slots):
        plan = _chunk_plan(lines, start, end, backend, tokens_per_pass).for_shard(sp)
        readout = _lines_readout(model, lines, start, _chunk_targets(lines, start, end), settings, compute_entropy,
                                 aux)
        out = run_pass(model, plan, lines.input_ids[start:end], lines.position_ids[start:end], readout)
        logps.append(out["logps"])
        if compute_entropy:
            entropies.append(out["entropy"])
        if aux:
            router.append(out["router_logits"])

    def scatter(values: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat(values)
        grid = flat.new_zeros(lines.num_rows, lines.logits_to_keep)
        return grid.index_put((lines.out_row, lines.out_col), flat)

    aux_loss = None
    if aux:
        aux_loss = _load_balancing_loss(model, torch.cat(router, dim=1), lines, aux_row_chunks)
    return scatter(logps), (scatter(entropies) if compute_entropy else None), aux_loss


def _load_balancing_loss(model, router_logits: torch.Tensor, lines: GroupLines,
                         row_chunks: list[torch.Tensor]) -> torch.Tensor:
    """TRL's MoE aux loss: the mean over its forwards of transformers' (Mixtral) `load_balancing_loss_func`
    over that forward's real tokens. router_logits: [layers, B*S, experts] in line-slot order."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = text_config(base_model(model))
    layers = tuple(router_logits.unbind(0))
    losses = [load_balancing_loss_func(layers, cfg.num_experts, cfg.num_experts_per_tok,
                                       aux_token_weights(lines, rows).reshape(1, -1))
              for rows in row_chunks]
    return torch.stack(losses).mean()
