"""One pass: a model run over a pass plan, its final hidden states at the positions a method asks for handed to
that method's head. Every method's forward is this function (`run_pass`): DPO's response log-probs
(`core.forward`), reward scores (`core.scores`), GRPO's per-token log-probs and entropies (`grpo.logps`).

What every pass shares lives here once: sequence parallelism (the plan's shard: this rank's columns in, its positions' head results
summed over the group out), prefix reuse (a plan with `reuse` runs its passes, `core.prefix_reuse`), the exact-zero
path from the model's own output (`model_call.zero_path`), the MoE router logits, and the refusal of each
combination that is not built.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

from prefixdpo.core.attention.pass_plan import PassPlan
from prefixdpo.core.model_call import model_pass, through_engine
from prefixdpo.core.moe import recording_router_logits
from prefixdpo.core.prefix_reuse import reused_hidden_states
from prefixdpo.errors import ConfigError

# head(hidden [t, D], mine, min_rows) -> {name: [t, ...]}: hidden at the positions this rank holds, in order; mine:
# bool [T], which of the asked positions those are (None: all, no sequence parallelism); min_rows: the most positions
# any rank of the group holds (t without sequence parallelism: a chunked head calls its weights as often on each).
Head = Callable[[torch.Tensor, "torch.Tensor | None", int], dict]


@dataclasses.dataclass(frozen=True, eq=False)
class Readout:
    """What a method reads from a pass.

    line, column: [T] long, the positions (of the whole lines) whose final hidden states go to `head` (`Head`);
    model_inputs: the method's other keywords to the model (e.g. `logits_to_keep`);
    check: called once a pass with the hidden states at the last column [B, D] and the model's own logits there
           [B, V], where the model returned them (e.g. that a hidden-state head equals the model's);
    router_logits: also return each MoE layer's router logits, stacked [layers, B x L (this rank's), experts]."""

    line: torch.Tensor
    column: torch.Tensor
    head: Head
    model_inputs: dict = dataclasses.field(default_factory=dict)
    check: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    router_logits: bool = False


def refuse_unbuilt(reuse: bool, sp, router_logits: bool) -> None:
    """One-line ConfigErrors for what a pass does not combine: prefix reuse with sequence parallelism (`sp`), and the
    MoE load-balancing loss (its router logits) with either."""
    if reuse and sp is not None:
        raise ConfigError("prefix_reuse=true is not supported with sequence parallelism yet: set one of them off")
    if router_logits and reuse:
        raise ConfigError("prefix_reuse does not compute the MoE load-balancing loss (its router logits come in "
                          "chunks, not the lines' layout): set router_aux_loss_coef 0, or prefix_reuse false")
    if router_logits and sp is not None:
        raise ConfigError("sequence parallelism does not compute the MoE load-balancing loss yet: set "
                          "router_aux_loss_coef 0, or sequence_parallel_size 1")


def _hidden_states(model, inner_forward, input_ids, position_ids, plan: PassPlan, model_inputs: dict):
    """(hidden [B, L, D], the model's last-position logits or None, zero path) of `plan`: one model call, or the
    passes its prefix reuse plans (no logits; their zero paths are in the hidden states)."""
    if plan.reuse is not None:
        return reused_hidden_states(model, inner_forward, input_ids, position_ids, plan, model_inputs), None, 0.0
    return model_pass(model, inner_forward, input_ids, position_ids, plan, **model_inputs)


def run_pass(model, plan: PassPlan, input_ids: torch.Tensor, position_ids: torch.Tensor, readout: Readout) -> dict:
    """Run `model` over `plan` (input_ids, position_ids [B, L] of the whole lines) and return `readout.head`'s
    results at every asked position, [T, ...] each (on every rank of the plan's sequence-parallel group), plus
    `router_logits` if asked. Grad follows torch.is_grad_enabled()."""
    sp = plan.sequence_parallel
    refuse_unbuilt(plan.reuse is not None, sp, readout.router_logits)
    line, column, mine, min_rows = readout.line, readout.column, None, int(readout.line.shape[0])
    if sp is not None:  # this rank's columns of the lines, and the asked positions among them
        length = input_ids.shape[1]
        min_rows = sp.most_owned(column, length)
        mine, column = sp.owned(column, length)
        line = line[mine]
        input_ids, position_ids = sp.shard(input_ids), sp.shard(position_ids)

    def body(inner_forward, input_ids, position_ids) -> dict:
        with recording_router_logits(model) if readout.router_logits else contextlib.nullcontext() as router:
            hidden, last_logits, zero = _hidden_states(model, inner_forward, input_ids, position_ids, plan,
                                                       readout.model_inputs)
        if readout.check is not None and last_logits is not None:
            readout.check(hidden[:, -1], last_logits)
        out = readout.head(hidden[line, column], mine, min_rows)
        if sp is not None:
            out = {name: sp.gathered(values, mine) for name, values in out.items()}
        out = {name: values + zero for name, values in out.items()}
        if readout.router_logits:
            out["router_logits"] = torch.stack([r.reshape(-1, r.shape[-1]) for r in router])
        return out

    return through_engine(model, body, input_ids=input_ids, position_ids=position_ids)


__all__ = ["Head", "Readout", "refuse_unbuilt", "run_pass"]
