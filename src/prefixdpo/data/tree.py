"""Token trees: the sequences of several records that share leading tokens run those tokens once, in one line.

Every `[prompt][response k]` sequence of a line's examples goes into a token trie: a token that several sequences
share with all the tokens before it (a system prompt, a prompt several records name, the earlier turns of a
dialogue) is one node, laid out once. The line is the trie in depth-first order::

    input_ids:    each trie node's token once, depth first (a node's subtree right after it)
    position_ids: the node's depth (tokens above it): every sequence sees its own positions 0 .. n-1
    span:         [tin, tout): the node's row position and the end of its subtree in the line

    q may attend kv  <=>  tin[kv] <= tin[q] < tout[kv]      (kv is q or one of q's ancestors)

which is the rule of every line (`data.lines.Lines`; a prefix-shared row is its depth-1 case) at any depth: a query
sees exactly the tokens of its own sequence before it, at their own positions, so every response's log-probs
equal its plain `[prompt][response]` pass. Each response token is predicted by the node before it on its own
sequence (the prompt's last token for the first one), wherever in the line that node is.

A line of tries is a `data.lines.Lines` as every layout is (the prefix-shared row is its depth-1 case): every
attention backend runs it by the one span rule. A response's sequence is its last token's node and that node's
ancestors (`Lines.response_last`): reward scores are read there, and the MoE aux loss weighs each node by the TRL
rows through it. DPO and reward-model training build tree lines with `prefix_tree=true` (the loader plans its
lines with `plan_tree_lines`); `bench` runs them (`trie-packed`) and `inspect` reports what they save.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from prefixdpo.data.batch import Batch, batch_of, response_offsets
from prefixdpo.data.example import Example
from prefixdpo.data.lines import Row
from prefixdpo.data.packing import plan_packs


@dataclass(frozen=True)
class TreeLine:
    """The trie of some examples' sequences, depth first. All tuples have the line's length n unless noted.

    input_ids, position_ids (depths), tin, tout: [n]
    sequences: one per response of the examples (example by example), the row positions of its whole
               `[prompt][response]` sequence, in order
    """

    input_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    tin: tuple[int, ...]
    tout: tuple[int, ...]
    sequences: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def depth(self) -> int:
        """Branching levels of the tree: the most times one sequence passes a node with several children
        (1 for a prompt and its responses; 0 for one sequence alone)."""
        splits: dict[int, set[int]] = {}
        for seq in self.sequences:
            for a, b in zip(seq, seq[1:]):
                splits.setdefault(a, set()).add(b)
        branching = {a for a, nexts in splits.items() if len(nexts) > 1}
        return max((sum(p in branching for p in seq) for seq in self.sequences), default=0)


def _insert(children: list[dict[int, int]], tokens: list[int], parent: list[int], sequence) -> list[int]:
    """Add `sequence` to the trie (node 0 is the root, no token); return its nodes."""
    node, path = 0, []
    for t in sequence:
        nxt = children[node].get(t)
        if nxt is None:
            nxt = len(tokens)
            children[node][t] = nxt
            children.append({})
            tokens.append(t)
            parent.append(node)
        path.append(nxt)
        node = nxt
    return path


def tree_line(examples: Sequence[Example]) -> TreeLine:
    """The token trie of every `[prompt][response]` sequence of `examples`, laid out depth first (module
    docstring). Children in the order their first sequence came."""
    children: list[dict[int, int]] = [{}]
    tokens, parent = [-1], [-1]
    paths = [_insert(children, tokens, parent, ex.prompt_ids + r) for ex in examples for r in ex.response_ids]
    size = [1] * len(tokens)
    for node in range(len(tokens) - 1, 0, -1):  # a child is always created after its parent
        size[parent[node]] += size[node]
    row, depth = [0] * len(tokens), [0] * len(tokens)
    order: list[int] = []
    stack = list(reversed(children[0].values()))
    while stack:
        node = stack.pop()
        row[node] = len(order)
        depth[node] = depth[parent[node]] + 1 if parent[node] else 0
        order.append(node)
        stack.extend(reversed(children[node].values()))
    return TreeLine(
        input_ids=tuple(tokens[n] for n in order),
        position_ids=tuple(depth[n] for n in order),
        tin=tuple(row[n] for n in order),
        tout=tuple(row[n] + size[n] for n in order),
        sequences=tuple(tuple(row[n] for n in path) for path in paths),
    )


def tree_row(examples: Sequence[Example]) -> Row:
    """The token trie of `examples` (`tree_line`) as the piece a line holds (`lines.Row`): the responses numbered
    0, 1, ... example by example; each response token predicted by the node before it on its own sequence."""
    tree = tree_line(examples)
    target_index: list[int] = []
    target_ids: list[int] = []
    target_response: list[int] = []
    last: list[int] = []
    sequences = iter(tree.sequences)
    for ex in examples:
        p = len(ex.prompt_ids)
        for response in ex.response_ids:
            seq = next(sequences)
            target_index.extend(seq[p - 1 : p - 1 + len(response)])
            target_ids.extend(response)
            target_response.extend([len(last)] * len(response))
            last.append(seq[-1])
    return Row(tree.input_ids, tree.position_ids, tree.tout, tuple(target_index), tuple(target_ids),
               tuple(target_response), tuple(range(len(last))), tuple(last))


def build_tree_batch(examples: Sequence[Example], lines: Sequence[Sequence[int]] | None = None, *,
                     pad_token_id: int = 0, length: int | None = None, pad_multiple: int = 1) -> Batch:
    """A Batch of tree lines: `lines` groups example indices (None: all in one line), each group one token trie
    (`tree_row`), padded to `length` (default the longest line, rounded up to `pad_multiple`). Responses are
    numbered example by example, pairs in example order, as in every Batch."""
    lines = [list(range(len(examples)))] if lines is None else [list(line) for line in lines]
    if sorted(e for line in lines for e in line) != list(range(len(examples))):
        raise ValueError("lines must hold every example of the batch exactly once")
    offsets = response_offsets(examples)
    pieces = [[(tree_row([examples[e] for e in line]), [r for e in line for r in range(offsets[e], offsets[e + 1])])]
              for line in lines]
    return batch_of(examples, pieces, pad_token_id=pad_token_id, length=length, pad_multiple=pad_multiple)


# ---- planning lines of tries (training's `prefix_tree`) ----------------------------------------------------------


def _sequences(example: Example) -> list[np.ndarray]:
    """The `[prompt][response k]` token sequences of `example`, one int64 array each."""
    return [np.asarray(example.prompt_ids + response, dtype=np.int64) for response in example.response_ids]


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common leading run of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _added_tokens(sequences: Sequence[np.ndarray], existing: Sequence[np.ndarray]) -> int:
    """Nodes `sequences` add, one after another, to the trie of `existing`: a trie's nodes are its sequences'
    distinct prefixes, so a sequence adds its length less the longest run it shares with one already in."""
    seen = list(existing)
    added = 0
    for sequence in sequences:
        added += len(sequence) - max((_common_length(sequence, other) for other in seen), default=0)
        seen.append(sequence)
    return added


def trie_costs(examples: Sequence[Example], order: Sequence[int]) -> tuple[list[int], list[int]]:
    """(alone, added), each [N] over `order`: the tokens of each example's own trie, and what it adds to the trie of
    the example before it in `order` (alone for the first). `added` bounds what an example adds to any line that
    holds the one before it: a trie holding more sequences already has at least those nodes."""
    alone, added = [], []
    previous: list[np.ndarray] = []
    for i in order:
        sequences = _sequences(examples[i])
        alone.append(_added_tokens(sequences, []))
        added.append(_added_tokens(sequences, previous) if previous else alone[-1])
        previous = sequences
    return alone, added


def _units(alone: Sequence[int], added: Sequence[int], pack_length: int) -> list[tuple[int, int]]:
    """Runs [a, b) of consecutive positions, each a subtree that fits a line whole: a run too big is cut where its
    neighbours share fewest tokens (its root's children), again until every run fits (one example always does)."""
    cumulative = np.concatenate([[0], np.cumsum(added)]).tolist()
    size = lambda a, b: alone[a] + cumulative[b] - cumulative[a + 1]  # noqa: E731 (tokens of run [a, b) alone)
    units, todo = [], [(0, len(alone))]
    while todo:
        a, b = todo.pop()
        if b - a == 1 or size(a, b) <= pack_length:
            units.append((a, b))
            continue
        shared = [alone[i] - added[i] for i in range(a + 1, b)]
        least = min(shared)
        bounds = [a, *(a + 1 + k for k, s in enumerate(shared) if s == least), b]
        todo.extend(reversed(list(zip(bounds, bounds[1:]))))
    return units


@dataclass(frozen=True)
class TreePlan:
    """Lines of tries over examples: `lines` [line][example index]; `splits` subtrees cut across lines (too big for
    one line, or cut by a line's end), each part repeating their shared prefix; `repeated_tokens` the tokens so
    computed again (beyond the prefix every sequence starts with, which every line holds anyway)."""

    lines: list[list[int]]
    splits: int = 0
    repeated_tokens: int = 0

    def summary(self) -> str:
        """One line for logs."""
        return (f"prefix_tree: {sum(map(len, self.lines))} examples in {len(self.lines)} lines of tries; {self.splits} "
                f"subtrees cut across lines, repeating their prefix ({self.repeated_tokens} tokens computed again)")


def common_prefix(examples: Sequence[Example]) -> int:
    """Tokens every `[prompt][response]` sequence of `examples` starts with (a BOS, a chat template's header, a system
    prompt): every line of tries holds them, whatever the lines."""
    first = examples[0].prompt_ids + examples[0].response_ids[0]
    n = len(first)
    for ex in examples:
        for response in ex.response_ids:
            sequence = ex.prompt_ids + response
            n = next((k for k, (a, b) in enumerate(zip(first[:n], sequence)) if a != b), min(n, len(sequence)))
    return n


def plan_tree_lines(examples: Sequence[Example], pack_length: int, order: Sequence[int] | None = None) -> TreePlan:
    """Examples into lines whose tries (`tree_line`) hold at most `pack_length` tokens.

    Default (`order` None): the examples in `trie_order` (one subtree's examples side by side) are cut into runs
    that fit a line (`_units`: a run too big is split into its root's children, each part then repeating their
    shared prefix, counted). Runs that share more than the prefix common to every sequence (`common_prefix`) fill
    chunks next fit, a run paying only for what it adds to the run before it; the chunks, each counted without the
    common prefix, go into lines best fit decreasing (`packing.plan_packs`), each line holding the common prefix
    once. With an `order` (sequential training): visited in that order and filled next fit, nothing reordered.
    Every example's own row fits `pack_length` (the loader checks it), so every example has a line."""
    keep_order = order is not None
    order = list(trie_order(examples) if order is None else order)
    if not order:
        return TreePlan([])
    alone, added = trie_costs(examples, order)
    common = 0 if keep_order else common_prefix(examples)
    chunks: list[list[int]] = []
    sizes: list[int] = []
    splits = repeated = 0
    for a, b in _units(alone, added, pack_length):
        shared = alone[a] - added[a] if a else 0  # tokens of example a already in the example before it
        continues = bool(chunks) and (keep_order or shared > common)  # the subtree of the chunk before goes on
        cost_here = sum(added[a:b])
        if continues and sizes[-1] + cost_here <= pack_length:
            chunks[-1].extend(order[a:b])
            sizes[-1] += cost_here
            continue
        if shared > common:  # a subtree split across lines: its prefix computed again
            splits += 1
            repeated += shared - common
        chunks.append(list(order[a:b]))
        sizes.append(alone[a] + sum(added[a + 1:b]))
    if keep_order:
        return TreePlan(chunks, splits, repeated)
    packs = plan_packs([max(1, n - common) for n in sizes], pack_length - common, shuffle=False)
    return TreePlan([[e for c in pack for e in chunks[c]] for pack in packs], splits, repeated)


def trie_order(examples: Sequence[Example]) -> list[int]:
    """Example indices sorted by their token sequences (prompt, then responses): examples that share leading tokens
    (a system prompt, a prompt, the earlier turns of a dialogue) come side by side, a prompt before its longer
    continuations."""
    return sorted(range(len(examples)), key=lambda i: (examples[i].prompt_ids, examples[i].response_ids))
