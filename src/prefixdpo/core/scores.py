"""Per-response reward scores from prefix-shared (or standard, packed or padded) lines.

A reward model (`AutoModelForSequenceClassification`, `num_labels=1`) scores a sequence with its score
head on the final hidden state of the sequence's last token. In a prefix-shared row every response
attends to exactly its prompt and itself, so the hidden state at a response's last token is the one a
separate `[prompt][response]` pass computes there: one body pass scores all K responses of a prompt.
On tree lines (`data.tree`) the same holds at any depth: a response's sequence is its last token's node, that
node's ancestors, in order, and nothing else, so every sequence sharing a node is scored in the one pass.

Which token is "last" follows the stock model (and so TRL's `RewardTrainer`): the rightmost token of
`[prompt][response]` that is not `config.pad_token_id` (TRL pads with the tokenizer's pad token, often
the EOS token that ends every response, so the score is read before a trailing EOS); position 0 of the
sequence if every token is the pad token; the very last token when the model has no pad token.

Everything that touches weights, the body and the score head, runs inside the forward of the module
the engine wraps (the one pass, `one_pass.run_pass`), so FSDP2 / ZeRO-3 see the score head's full weight.
"""

from __future__ import annotations

import torch

from prefixdpo.data.batch import Batch
from prefixdpo.data.lines import sequence_tokens
from prefixdpo.core import sequence_parallel
from prefixdpo.core.attention.pass_plan import PassPlan
from prefixdpo.core.model_checks import base_model, check_sequences_fit_window, text_config
from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.core.one_pass import Readout, run_pass


def score_head(model) -> torch.nn.Module:
    """The model's own score head (`score`: hidden [N, D] -> [N, 1]); refuses anything but one label.
    (Under PEFT, the trained copy of the head lives in the base model.)"""
    base = base_model(model)
    head = getattr(base, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise UnsupportedModelError(
            f"{type(base).__name__} has no `score` head: a reward model is a decoder "
            "AutoModelForSequenceClassification (e.g. LlamaForSequenceClassification)")
    labels = getattr(base.config, "num_labels", None)
    if labels != 1:
        raise UnsupportedModelError(
            f"{type(base).__name__} has num_labels={labels}; a reward model outputs one score (num_labels=1)")
    return head


def score_positions(batch: Batch, pad_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(line [R], column [R]) of the token whose hidden state scores each response (module docstring).

    The candidates of response r are the tokens of its own sequence (`lines.sequence_tokens`: its last token's
    ancestors and itself). -> the rightmost candidate that is not `pad_token_id` (any candidate if None), else the
    sequence's first token. (A line holds a sequence's tokens in their order.)
    """
    line = batch.response_line
    ids = batch.input_ids[line]  # [R, L]
    own = sequence_tokens(batch)
    kept = own if pad_token_id is None else own & (ids != pad_token_id)
    columns = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    last = torch.where(kept, columns, -1).amax(dim=1)
    first = torch.where(own, columns, ids.shape[1]).amin(dim=1)
    return line, torch.where(last >= 0, last, first)


def compute_response_scores(model, batch: Batch, plan: PassPlan) -> torch.Tensor:
    """Reward scores [R] (fp32) of every response of `batch`; grad follows torch.is_grad_enabled().

    plan: the batch's pass plan for the run's backend (`pass_plan.plan_pass`), built once by the caller. A batch with
    no response (a rank-balancing empty micro-batch) returns a [1] tensor: 0 x the head on no position, so every
    parameter takes part in the backward (DDP's and FSDP's collectives).
    """
    cfg = text_config(base_model(model))
    head = score_head(model)
    if cfg.pad_token_id is None and batch.input_ids.shape[0] > 1:
        raise UnsupportedModelError(
            "the reward model's config has no pad_token_id (set model.config.pad_token_id, as TRL's RewardTrainer "
            "does from the tokenizer's pad token): it marks where each sequence ends")
    check_sequences_fit_window(model, batch, plan.backend)
    empty = batch.num_responses == 0
    if empty:
        line = column = torch.zeros(0, dtype=torch.long, device=batch.input_ids.device)
    else:
        line, column = score_positions(batch, cfg.pad_token_id)

    def scores(hidden: torch.Tensor, mine, min_rows: int) -> dict:
        # the head's own dtype: under mixed precision the body's output may differ from the head's weights
        dtype = next(head.parameters()).dtype
        return {"scores": head(hidden.to(dtype)).float().squeeze(-1)}

    readout = Readout(line, column, scores)
    out = run_pass(model, plan.for_shard(sequence_parallel.of(model)), batch.input_ids, batch.position_ids, readout)
    out = out["scores"]
    return out.sum().reshape(1) * 0.0 if empty else out
