"""Per-response log-probs of any Hugging Face causal LM on prefix-shared lines: DPO's head on the one pass.

The pass (`one_pass.run_pass`) hands the final hidden states at the positions that predict a response token to the
LM head, applied there only (`logprobs.py`), inside the forward of the module the engine wraps
(`model_call.through_engine`). `logits_to_keep=1` keeps the model's own head to one position per line; that position
doubles as a check that our head path equals the model's.
"""

from __future__ import annotations

import torch

from prefixdpo.core import sequence_parallel
from prefixdpo.core.attention.pass_plan import PassPlan
from prefixdpo.core.logprobs import (
    ResponseLogps, TokenStat, UnsupportedModelError, check_head, lm_head_fn, response_sums, token_logps,
)
from prefixdpo.core.model_checks import check_sequences_fit_window, text_config, unwrap
from prefixdpo.core.moe import router_aux_loss
from prefixdpo.core.one_pass import Readout, run_pass
from prefixdpo.data.batch import Batch

__all__ = ["UnsupportedModelError", "causal_lm_inputs", "compute_response_logps", "unwrap"]


def causal_lm_inputs(model) -> dict:
    """The keywords of a causal LM's pass: its own head on one position only (`logits_to_keep=1`; ours runs where
    needed), and, for a MoE model, no router logits of its own: asked for them it computes its aux loss from
    `attention_mask` read as a [B, L] padding mask, which ours is not (`moe.recording_router_logits` collects them)."""
    moe = {"output_router_logits": False} if hasattr(text_config(unwrap(model)), "output_router_logits") else {}
    return {"logits_to_keep": 1, **moe}


def _head_check(model, head):
    """The once-per-model check that `head` on the hidden states [B, D] equals the model's own logits [B, V]."""
    hf = unwrap(model)

    def check(hidden: torch.Tensor, model_logits: torch.Tensor) -> None:
        if not getattr(hf, "_prefixdpo_head_checked", False):
            check_head(head, hidden, model_logits)
            hf._prefixdpo_head_checked = True

    return check


def compute_response_logps(
    model, batch: Batch, plan: PassPlan, *, chunk_size: int = 1024, stat: TokenStat | None = None,
    router_aux: bool = False,
) -> ResponseLogps:
    """Per-response log-prob sums and token counts for `batch` (grad follows torch.is_grad_enabled()).

    plan: the batch's pass plan for the run's backend (`pass_plan.plan_pass`), built once per micro-batch by the
          caller and shared by every pass over it (policy, reference, pre-pass).
    stat: a per-token statistic of the same head pass, summed per response (`ResponseLogps.stat_sums`).
    router_aux: also the MoE load-balancing loss of this pass (`ResponseLogps.aux_loss`, TRL's).
    """
    check_sequences_fit_window(model, batch, plan.backend)
    head = lm_head_fn(unwrap(model))

    def logps(hidden: torch.Tensor, mine, min_rows: int) -> dict:
        ids = batch.target_ids if mine is None else batch.target_ids[mine]
        if stat is None:
            return {"per_token": token_logps(head, hidden, ids, chunk_size, min_tokens=min_rows)}
        per_token, stats = token_logps(head, hidden, ids, chunk_size, stat=stat, min_tokens=min_rows)
        return {"per_token": per_token, "stats": stats}

    readout = Readout(batch.target_line, batch.target_col, logps, model_inputs=causal_lm_inputs(model),
                      check=_head_check(model, head), router_logits=router_aux)
    out = run_pass(model, plan.for_shard(sequence_parallel.of(model)), batch.input_ids, batch.position_ids, readout)
    result = response_sums(out["per_token"], out.get("stats"), batch)
    if router_aux:
        result.aux_loss = router_aux_loss(model, list(out["router_logits"].unbind(0)), batch)
    return result
