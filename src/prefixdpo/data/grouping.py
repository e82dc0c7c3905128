"""`group_by_prompt`: examples whose prompts are the same tokens become one example with K responses.

Preference data often names one prompt in many records (SHP: ~10 pairs per post; all-pairs expansions of
UltraFeedback; several rated responses of one prompt in separate rows). Each record alone computes the
prompt once per record; grouped, the prompt is computed once per group and a response named by several
records once::

    record 4: P > [a] vs [b]        group:  [ P ][ a ][ b ][ c ]      pairs (0, 1), (0, 2), (2, 1)
    record 9: P > [a] vs [c]                                           (record 4's, record 9's, record 11's)
    record 11: P > [c] vs [b]

Every pair a record names is kept, in record order (a pair two records name is kept twice, as standard DPO
trains it twice), and each pair's loss is exactly the one it has alone: a response's log-probs depend only
on `[prompt][response]`. Per-pair data travels with the pair: `meta["margin"]` (a reward margin; a number
per record) becomes a tuple with one margin per pair, and `meta["records"]` / `meta["pair_records"]` name the
records. What changes is which pairs share an optimizer step (a batch counts examples, so a grouped example
brings all of its prompt's pairs into one step), as `group_by_length` changes it.

An example whose metadata holds a key grouping cannot merge (not a margin, not reporting-only) with a value
that differs from its group's is kept apart, ungrouped, and counted (`GroupReport.kept_apart`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from prefixdpo.data.example import Example
from prefixdpo.data.loader import MARGIN  # the reward margin: per pair once grouped

RECORDS = "records"  # meta of a grouped example: the source indices of its records, in order
PAIR_RECORDS = "pair_records"  # meta of a grouped example: [P] the record each pair comes from
# Per-record metadata that only reports what preparation did (already counted in the data report): a group
# keeps none of it, so records that differ in it still group.
REPORTING_ONLY = frozenset({"format", "scores", "boundary_adjusted", "truncated", "completion_indices"})


@dataclass
class GroupReport:
    """What grouping did to one dataset.

    examples_in / examples_out: examples before and after; pairs: preference pairs (the same before and after).
    groups:            output examples made of 2 or more input examples.
    responses_in / responses_out: responses before and after (duplicates named by several records run once).
    tokens_in / tokens_out: tokens of the prefix-shared rows before and after.
    split:             groups cut into several rows to fit `max_row_length` (each part repeats the prompt).
    kept_apart:        examples left ungrouped because their metadata could not merge; kept_apart_example:
                       the first one's message.
    """

    examples_in: int = 0
    examples_out: int = 0
    pairs: int = 0
    groups: int = 0
    responses_in: int = 0
    responses_out: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    split: int = 0
    kept_apart: int = 0
    kept_apart_example: str = ""

    @property
    def tokens_saved(self) -> float:
        """Fraction of prefix-shared row tokens grouping saves."""
        return 1.0 - self.tokens_out / self.tokens_in if self.tokens_in else 0.0

    def summary(self) -> str:
        """One line for logs and the CLI."""
        line = (f"group_by_prompt: {self.examples_in} examples -> {self.examples_out} rows ({self.groups} of them "
                f"merge 2+ records; all {self.pairs} pairs kept), {self.responses_in - self.responses_out} duplicate "
                f"responses run once, {self.tokens_saved:.1%} fewer row tokens")
        if self.split:
            line += f"; {self.split} groups split to fit pack_length (prompt repeated)"
        if self.kept_apart:
            line += f"; {self.kept_apart} kept apart ({self.kept_apart_example})"
        return line + "."


def _name(example: Example, position: int) -> str:
    return f"record {example.source_index}" if example.source_index >= 0 else f"example {position}"


def _conflict(first: Example, other: Example) -> str | None:
    """The metadata key `other` cannot merge into `first`'s group (differs, and is neither a margin nor
    reporting-only), or None."""
    keys = (set(first.meta) | set(other.meta)) - REPORTING_ONLY - {MARGIN, RECORDS, PAIR_RECORDS}
    for key in sorted(keys):
        if first.meta.get(key) != other.meta.get(key):
            return key
    return None


def _pair_margins(example: Example) -> tuple[float, ...] | None:
    """The example's margin per pair, or None when it has none."""
    margin = example.meta.get(MARGIN)
    if margin is None:
        return None
    if isinstance(margin, (tuple, list)):
        return tuple(float(m) for m in margin)
    return (float(margin),) * len(example.pairs)


def _record_of_pairs(example: Example) -> tuple[int, ...]:
    return tuple(example.meta.get(PAIR_RECORDS, (example.source_index,) * len(example.pairs)))


def merge_examples(members: Sequence[Example]) -> Example:
    """One example of `members` (same prompt tokens): responses in first-seen order, each distinct token
    sequence once, and every member's pairs in member order, remapped. A single member is returned as is."""
    if len(members) == 1:
        return members[0]
    prompt = members[0].prompt_ids
    assert all(m.prompt_ids == prompt for m in members), "merge_examples: prompts differ"
    responses: list[tuple[int, ...]] = []
    index_of: dict[tuple[int, ...], int] = {}

    def place(tokens: tuple[int, ...]) -> int:
        if tokens not in index_of:
            index_of[tokens] = len(responses)
            responses.append(tokens)
        return index_of[tokens]

    pairs: list[tuple[int, int]] = []
    for m in members:
        for i, j in m.pairs:
            better, worse = place(m.response_ids[i]), place(m.response_ids[j])
            if better == worse:  # a pair of two equal token sequences (both cut to one length): keep it a pair
                worse = len(responses)
                responses.append(m.response_ids[j])
            pairs.append((better, worse))
    meta = {key: value for key, value in members[0].meta.items() if key not in REPORTING_ONLY | {MARGIN}}
    margins = [_pair_margins(m) for m in members]
    if any(m is not None for m in margins):
        meta[MARGIN] = tuple(x for m, member in zip(margins, members) for x in (m or (0.0,) * len(member.pairs)))
    meta[RECORDS] = tuple(r for m in members for r in m.meta.get(RECORDS, (m.source_index,)))
    meta[PAIR_RECORDS] = tuple(r for m in members for r in _record_of_pairs(m))
    return Example(prompt, responses, pairs, members[0].source_index, meta)


def _parts(members: list[Example], max_row_length: int | None) -> list[list[Example]]:
    """`members` cut, in order, into runs whose merged row fits `max_row_length` (None: one run). A member
    alone longer than the limit is a run of its own (the packer then names it)."""
    if max_row_length is None:
        return [members]
    parts: list[list[Example]] = []
    seen: set[tuple[int, ...]] = set()
    length = 0
    for m in members:
        new = {r for r in m.response_ids if r not in seen}
        grown = length + sum(len(r) for r in new)
        if parts and grown <= max_row_length:
            parts[-1].append(m)
            seen |= new
            length = grown
        else:
            parts.append([m])
            seen = set(m.response_ids)
            length = len(m.prompt_ids) + sum(len(r) for r in seen)
    return parts


def group_by_prompt(examples: Sequence[Example], max_row_length: int | None = None
                    ) -> tuple[list[Example], GroupReport]:
    """Examples with the same prompt token ids merged into one (`merge_examples`), in order of each prompt's
    first example; the report counts what changed.

    max_row_length: a merged row longer than this (the pack length, with packing) is cut into several
                    examples, each repeating the prompt (counted in `report.split`).
    """
    report = GroupReport(examples_in=len(examples))
    group_of: dict[tuple[int, ...], int] = {}  # prompt -> its group (index into `order`)
    order: list[list[Example]] = []
    first_position: list[int] = []  # per group: its first example's position (for the report)
    for position, ex in enumerate(examples):
        g = group_of.get(ex.prompt_ids)
        key = None if g is None else _conflict(order[g][0], ex)
        if g is not None and key is None:
            order[g].append(ex)
            continue
        if g is not None:
            report.kept_apart += 1
            report.kept_apart_example = report.kept_apart_example or (
                f"{_name(ex, position)}: meta {key!r} differs from {_name(order[g][0], first_position[g])}'s")
        else:
            group_of[ex.prompt_ids] = len(order)
        order.append([ex])
        first_position.append(position)
    grouped: list[Example] = []
    for members in order:
        parts = _parts(members, max_row_length)
        report.split += len(parts) > 1
        report.groups += sum(len(part) > 1 for part in parts)
        grouped.extend(merge_examples(part) for part in parts)
    report.examples_out = len(grouped)
    report.pairs = sum(len(ex.pairs) for ex in examples)
    report.responses_in = sum(ex.num_responses for ex in examples)
    report.responses_out = sum(ex.num_responses for ex in grouped)
    report.tokens_in = sum(ex.shared_length for ex in examples)
    report.tokens_out = sum(ex.shared_length for ex in grouped)
    assert report.pairs == sum(len(ex.pairs) for ex in grouped), "group_by_prompt lost a pair"
    return grouped, report
