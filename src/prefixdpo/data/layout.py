"""`Example -> Row`: lay one example out as the token trie(s) the model runs (`data.lines.Row`).

Prefix-shared (one row per example, a depth-1 trie)::

    tokens:    [ prompt ........ ][ response 0 ..... ][ response 1 ...... ] ...
    positions:   0 ........ P-1     P ...... P+R0-1     P ....... P+R1-1      (restart after the prompt)
    subtree:     to the row's end   to response 0's end  to response 1's end

Standard (K rows per example): `[prompt][response k]` for each k, one chain each.

Every response token is predicted by the hidden state one step before it *in its own sequence*: the
first token of every response by the prompt's last position (no duplicated token), the others by the
previous token of the same response.
"""

from __future__ import annotations

from typing import Sequence

from prefixdpo.data.example import Example
from prefixdpo.data.lines import Row


def prefix_row(prompt: Sequence[int], responses: Sequence[tuple[int, Sequence[int]]],
               positions: Sequence[int] | None = None) -> Row:
    """`prompt` followed by each (response number, tokens), each a branch after the prompt (a depth-1 trie).

    positions: the position id of each token of the row (default: the prompt's 0..P-1, each response restarting at
    P); a GRPO group passes TRL's own. A response with no token still has a sequence: the prompt.
    """
    p = len(prompt)
    input_ids = list(prompt)
    tout = []
    target_index: list[int] = []
    target_ids: list[int] = []
    target_response: list[int] = []
    response_last = []
    own_positions = list(range(p))
    for k, tokens in responses:
        start = len(input_ids)
        n = len(tokens)
        input_ids.extend(tokens)
        own_positions.extend(range(p, p + n))
        tout.extend([start + n] * n)
        # token 0 is predicted by the prompt's last position, token j>0 by token j-1 of this response
        if n:
            target_index.append(p - 1)
            target_index.extend(range(start, start + n - 1))
        target_ids.extend(tokens)
        target_response.extend([k] * n)
        response_last.append(start + n - 1 if n else p - 1)
    tout = [len(input_ids)] * p + tout  # every prompt token's subtree holds the rest of the row
    return Row(tuple(input_ids), tuple(own_positions if positions is None else positions), tuple(tout),
               tuple(target_index), tuple(target_ids), tuple(target_response), tuple(k for k, _ in responses),
               tuple(response_last))


def shared_row(example: Example) -> Row:
    """The prefix-shared row: prompt once, then every response (response k the k-th branch)."""
    return prefix_row(example.prompt_ids, list(enumerate(example.response_ids)))


def separate_rows(example: Example) -> list[Row]:
    """Standard layout: one `[prompt][response k]` chain per response (numbered k)."""
    return [prefix_row(example.prompt_ids, [(k, r)]) for k, r in enumerate(example.response_ids)]


def layout_example(example: Example, prefix_sharing: bool = True) -> list[Row]:
    """The rows of one example: [shared_row] with prefix sharing, else one row per response."""
    return [shared_row(example)] if prefix_sharing else separate_rows(example)
