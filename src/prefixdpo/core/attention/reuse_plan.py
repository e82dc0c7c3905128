"""How a line too long for one pass is run by prefix reuse (`core.prefix_reuse` runs it): its shared prefix once,
then chunks of whole subtrees, each attending the prefix's cached keys and values (module doc there). Planning only:
which columns are the prefix and which the chunks, from the line's spans (`data.lines`).

The budget bounds the chunks, not the prefix nor one subtree: a prefix (prompt) longer than `max_tokens_per_pass`
runs in one pass of its own, and so does a single response (subtree) longer than it. Splitting either would need
each piece to attend the cached keys and values of the pieces before it (a prefix's pieces, or a response's own
earlier pieces beside the prefix's), and every rank of a sharded run to agree on a second kind of pass count
(`prefix_reuse.agreed_shape`); that is not built. Such passes are said instead (`OverBudget`): a warning at the first
line that holds one, naming it and by how much, and the count and the largest in the command's final report.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from prefixdpo.core.rank_decisions import rank_and_world
from prefixdpo.errors import ConfigError


@dataclass(frozen=True)
class LinePlan:
    """How one line runs: its prefix, columns [0, prefix), once; then `chunks` of whole subtrees [start, end)."""

    line: int
    prefix: int
    chunks: tuple[tuple[int, int], ...]

    def largest_pass(self) -> tuple[int, str]:
        """(tokens of the largest pass of this plan, what it is): the prefix's, or its largest chunk's."""
        chunk = max(end - start for start, end in self.chunks)
        return (self.prefix, "a shared prefix (prompt)") if self.prefix >= chunk else (chunk, "a single response")


class OverBudget:
    """The passes planned over `max_tokens_per_pass` in this process (module doc): the first is warned about once,
    the count and the largest are read by the command's final report (`summary`). `reset` at each trainer's start
    (`training.options.resolve_tokens_per_pass`)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.lines, self.largest, self.what, self.budget = 0, 0, "", 0

    def note(self, plan: LinePlan, budget: int) -> None:
        """Count `plan` if one of its passes holds more than `budget` tokens; warn at the first."""
        tokens, what = plan.largest_pass()
        if tokens <= budget:
            return
        if not self.lines:
            logging.getLogger(__name__).warning(
                "prefix reuse: %s of %d tokens runs in one pass, %d over max_tokens_per_pass=%d (the budget splits "
                "the responses after a prefix into chunks, not the prefix nor one response); said once, the count "
                "is in the final report", what, tokens, tokens - budget, budget)
        self.lines += 1
        if tokens > self.largest:
            self.largest, self.what, self.budget = tokens, what, budget

    def summary(self) -> str | None:
        """One line for the final report, or None when every pass held to the budget."""
        if not self.lines:
            return None
        return (f"Prefix reuse: {self.lines} lines ran a pass over max_tokens_per_pass={self.budget} (the largest: "
                f"{self.what} of {self.largest} tokens, {self.largest - self.budget} over; counted once per mask "
                "built, on this process)")


OVER_BUDGET = OverBudget()


@dataclass(frozen=True)
class PrefixReuse:
    """What a pass over a batch runs instead of one forward: per line a `LinePlan`, or None (one forward for all
    such lines); `backend`: the attention backend each pass's plan is built for. The `reuse` of a batch's pass plan
    (`pass_plan.plan_pass` builds it when a line is over the budget, and for every batch when the run has several
    ranks). aligned: the run has several ranks, which agree on the shape of the passes before
    running them (`core.prefix_reuse`: every rank makes the same model calls, as FSDP2's and ZeRO-3's gathers need)."""

    plans: tuple[LinePlan | None, ...]
    backend: str
    segment_waste: float = 0.25
    aligned: bool = False


def line_prefix(spans: torch.Tensor) -> tuple[int, int]:
    """(prefix length p, real tokens n) of one line's [L, 2] spans: p leading tokens whose subtree holds every
    other real token of the line (a chain, in a depth-first line); 0 when the line holds several tries."""
    tout = spans[:, 1]
    n = int((spans[:, 0] >= 0).sum())
    p = 0
    while p < n and int(tout[p]) >= n:
        p += 1
    return p, n


def plan_line(spans: torch.Tensor, line: int, max_tokens: int) -> LinePlan | None:
    """The plan of line `line` ([L, 2] spans) under a budget of `max_tokens` tokens per pass; None when the line fits
    one pass. Chunks are consecutive subtrees after the prefix, filled up to the budget (a subtree larger than the
    budget is a chunk alone). A line over the budget without a shared prefix (packed tries) is refused."""
    p, n = line_prefix(spans)
    if n <= max_tokens:
        return None
    if p == 0 or p >= n:
        raise ConfigError(f"prefix reuse: a line of {n} tokens is over max_tokens_per_pass={max_tokens} but its tokens "
                          "share no prefix (several packed examples); run such examples unpacked")
    tout = spans[:, 1].tolist()
    chunks: list[list[int]] = []
    start = p
    while start < n:
        end = tout[start]  # one subtree
        if chunks and end - chunks[-1][0] <= max_tokens:
            chunks[-1][1] = end
        else:
            chunks.append([start, end])
        start = end
    return LinePlan(line, p, tuple((a, b) for a, b in chunks))


def reused_tokens(prompt: int, responses: list[int], max_tokens: int) -> int:
    """The most tokens whose activations a prefix-reused prompt of `prompt` tokens with responses of `responses`
    tokens keeps at once: the prompt and its largest chunk (`plan_line`'s chunks, from lengths); the whole row when
    it fits `max_tokens`."""
    total = prompt + sum(responses)
    if total <= max_tokens:
        return total
    chunks: list[int] = []
    for n in responses:
        if chunks and chunks[-1] + n <= max_tokens:
            chunks[-1] += n
        else:
            chunks.append(n)
    return prompt + max(chunks)


def plan_reuse(spans: torch.Tensor, max_tokens: int, backend: str, segment_waste: float = 0.25) -> PrefixReuse | None:
    """The `PrefixReuse` of [B, L, 2] spans, or None when every line fits `max_tokens` (one ordinary pass) in a run
    of one process. With several ranks every batch gets one (`aligned`): another rank's batch may need chunks, and
    this one's passes must match them."""
    if max_tokens < 1:
        raise ConfigError(f"max_tokens_per_pass={max_tokens}: expected a positive number of tokens")
    plans = tuple(plan_line(spans[b].cpu(), b, max_tokens) for b in range(spans.shape[0]))
    for plan in plans:
        if plan is not None:
            OVER_BUDGET.note(plan, max_tokens)
    aligned = rank_and_world()[1] > 1
    if all(plan is None for plan in plans) and not aligned:
        return None
    return PrefixReuse(plans, backend, segment_waste, aligned)


__all__ = ["LinePlan", "OverBudget", "OVER_BUDGET", "PrefixReuse", "line_prefix", "plan_line", "plan_reuse", "reused_tokens"]
