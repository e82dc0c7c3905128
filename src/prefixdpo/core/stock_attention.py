"""The route of a model prefix sharing cannot run yet, with `prefix_sharing` off: TRL's own passes.

A model whose layers prefixdpo's attention does not reproduce (a convolution or recurrent state carried along the
sequence, attention sinks on a backend without them, a model that builds its masks itself: `model_checks.refusal`)
still trains with prefix sharing off, as TRL's trainers train it: each `[prompt][response]` its own right-padded row
(`data.layout.separate_rows`), the model's *own* attention implementation (sdpa, or eager where it has no sdpa, as
gpt-oss), and a plain 2D padding mask [B, L]. That is the mask those models build every one of their masks from:
their linear-attention and convolution layers zero padded states with it (Qwen3.5's
`apply_mask_to_padding_states(hidden, attention_mask)` expects [B, L]), so a 4D mask or a BlockMask would break them.
Right padding keeps a causal recurrence exact: a padded slot comes after every real token of its row.

A packed line would run a recurrence from one sequence into the next, so this route runs unpacked lines only (packing
is refused, `model_setup.check_stock_route`). The route is named by the pass backend `STOCK` (`prepare_model` returns
it), so every pass of the run (policy, reference, reference tables) builds its plan with `plan_run_pass`: a
`PassPlan` whose model mask is the padding mask and which no attention of prefixdpo's reads.
"""

from __future__ import annotations

import torch

from prefixdpo.core.attention.backends import ATTENTION_NAME
from prefixdpo.core.attention.pass_plan import STOCK, PassPlan, plan_pass


def stock_implementation(model) -> str:
    """The attention implementation `model` runs on this route: its own, or, where it was switched to prefixdpo's,
    the one transformers would load it with (sdpa where the model supports it, else eager)."""
    own = getattr(model.config, "_attn_implementation", None)
    if own and own != ATTENTION_NAME:
        return own
    return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"


_MARK = "_prefixdpo_stock_attention"  # set on a model this route runs: its passes are TRL's, no limit of ours holds


def use_stock_attention(model, on: bool = True) -> None:
    """Run `model` (a transformers model, PEFT unwrapped) on its own attention implementation, marked as on this
    route (`on_stock_route`); on=False: only clear the mark (the model goes to prefixdpo's attention)."""
    setattr(model, _MARK, on)
    if not on:
        return
    wanted = stock_implementation(model)
    if getattr(model.config, "_attn_implementation", None) != wanted:
        model.set_attn_implementation(wanted)


def on_stock_route(model) -> bool:
    """Whether `model` (a transformers model, PEFT unwrapped) runs this route: its own attention slides its window
    and sinks its attention exactly, so the checks of prefixdpo's attention (a sliding window over a shared row) do
    not apply."""
    return bool(getattr(model, _MARK, False))


def padding_mask(lines) -> torch.Tensor:
    """The 2D padding mask [B, L] long (1: a token, 0: padding) of `lines` (a `data.lines.Lines`, or its [B, L, 2]
    spans, padding (-1, -1)): what TRL hands the model with right-padded rows. Each line must hold one sequence from
    its first column (unpacked, unshared: `data.layout.separate_rows`), as this route lays them out."""
    spans = lines if isinstance(lines, torch.Tensor) else lines.spans
    return (spans[..., 0] >= 0).long()


def plan_run_pass(lines, backend: str, **options) -> PassPlan:
    """The plan of a pass over `lines` on a resolved `backend`: on the `STOCK` route, a plan whose model mask is the
    padding mask (the model's own attention builds its masks from it), else prefixdpo's (`pass_plan.plan_pass`, with
    its `options`)."""
    if backend == STOCK:
        spans = lines if isinstance(lines, torch.Tensor) else lines.spans
        return PassPlan(spans=spans, backend=STOCK, mask=padding_mask(spans))
    return plan_pass(lines, backend, **options)
