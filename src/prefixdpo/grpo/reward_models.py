"""Reward models among TRL's reward functions, scoring each prompt's completions on shared lines.

TRL 1.16 (`_calculate_rewards`) scores a reward model (an `AutoModelForSequenceClassification`, one label) on the
texts `prompt + completion` of all N rows, tokenized by the reward model's tokenizer and right-padded: the tokens a
prompt's G rows share run G times. Here the rows TRL tokenized are grouped by their prompt, each group becomes one
`Example` (prompt = the tokens all its rows start with, responses = the rest of each row), and the groups' token
tries (`data.tree`) run in lines with the core scorer (`core.scores.compute_response_scores`): the
shared tokens once (a system prompt shared across groups too), every row's score read at the token TRL's model reads
it at (its last token that is not the pad token). The scores equal TRL's to float rounding.

Only TRL's call is replaced (`SharedPrefixScorer` stands in for the model for the duration of `_calculate_rewards`,
taking the same inputs and returning `.logits` [N, 1]); a call sharing cannot reproduce (inputs besides token ids,
a row of a single token) runs the model as TRL does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch

from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.data.example import Example
from prefixdpo.data.packing import auto_pack_length
from prefixdpo.data.lines import bucket_length
from prefixdpo.data.tree import build_tree_batch, plan_tree_lines, tree_line
from prefixdpo.core.scores import compute_response_scores


def _common_length(rows: list[list[int]]) -> int:
    first = rows[0]
    n = min(len(r) for r in rows)
    for row in rows[1:]:
        n = next((k for k in range(n) if row[k] != first[k]), n)
    return n


def group_examples(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   row_groups: list[int]) -> tuple[list[Example], list[list[int]]] | None:
    """TRL's reward rows [N, L] (real tokens where the mask is 1) -> (one Example per group, the TRL rows of each
    example's responses, in order); None when a row has a single token or a group's rows share no first token.

    An example's prompt is the tokens all its rows start with, but at least one token short of the shortest row (a
    response is never empty); a group of one row repeats its last token as a second response (the trie runs it
    once; its score is read once)."""
    rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
    if any(len(r) < 2 for r in rows):
        return None
    members: dict[int, list[int]] = {}
    for i, g in enumerate(row_groups):
        members.setdefault(g, []).append(i)
    examples, rows_of = [], []
    for idx in members.values():
        group = [rows[i] for i in idx]
        p = min(_common_length(group), min(len(r) for r in group) - 1)
        if p == 0:  # the rows of one prompt start differently: an empty prompt text, nothing shared
            return None
        responses = [r[p:] for r in group]
        if len(responses) == 1:
            responses.append(responses[0])
        examples.append(Example(group[0][:p], responses, pairs=((0, 1),)))
        rows_of.append(idx)
    return examples, rows_of


def shared_reward_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, row_groups: list[int], *,
                         backend: str, packing: bool = True, pack_length="auto") -> torch.Tensor | None:
    """Scores [N] (fp32) of TRL's reward rows, each group's tokens run once (module doc); None where
    `group_examples` is. The model's pad token is what the rows were padded with (TRL sets it)."""
    grouped = group_examples(input_ids, attention_mask, row_groups)
    if grouped is None:
        return None
    examples, rows_of = grouped
    sizes = [ex.shared_length for ex in examples]
    if not packing:
        lines = [[e] for e in range(len(examples))]
    else:
        length = auto_pack_length(sizes) if pack_length == "auto" else max(int(pack_length), max(sizes))
        lines = plan_tree_lines(examples, length).lines
    length = None
    if backend in ("flex", "varlen"):  # compiled kernels: a few line lengths, as the log-prob passes bucket them
        length = bucket_length(max(len(tree_line([examples[e] for e in line])) for line in lines))
    pad = getattr(model.config, "pad_token_id", None)
    batch = build_tree_batch(examples, lines, pad_token_id=0 if pad is None else int(pad), length=length)
    batch = batch.to(input_ids.device)
    scores = compute_response_scores(model, batch, plan_pass(batch, backend))  # [R], example by example
    out = torch.empty(input_ids.shape[0], dtype=scores.dtype, device=scores.device)
    r = 0
    for ex, idx in zip(examples, rows_of):
        out[torch.tensor(idx, device=out.device)] = scores[r:r + len(idx)]
        r += ex.num_responses
    return out


class SharedPrefixScorer(torch.nn.Module):
    """Stands in for a reward model in TRL's call ``model(**reward_inputs).logits[:, 0]`` (module doc).

    row_groups: [N] the group (prompt) of each row; `fallback(reason)` is told why a call ran the model as TRL does."""

    def __init__(self, model, row_groups: list[int], *, backend: str, packing: bool, pack_length,
                 fallback: Callable[[str], None]):
        super().__init__()
        self.model = model
        self.row_groups = row_groups
        self.settings = dict(backend=backend, packing=packing, pack_length=pack_length)
        self.fallback = fallback

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids=None, attention_mask=None, **others):
        extra = sorted(k for k, v in others.items() if v is not None)
        if extra or input_ids is None or attention_mask is None:
            self.fallback(f"the reward model receives {', '.join(extra) or 'no token ids with a mask'}")
            return self.model(input_ids=input_ids, attention_mask=attention_mask, **others)
        scores = shared_reward_scores(self.model, input_ids, attention_mask, self.row_groups, **self.settings)
        if scores is None:
            self.fallback("a reward row holds a single token, or one prompt's rows start with different tokens")
            return self.model(input_ids=input_ids, attention_mask=attention_mask)
        return SimpleNamespace(logits=scores[:, None])
