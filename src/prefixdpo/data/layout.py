"""`Example -> Row`: lay one example out as the token sequence(s) the model runs.

Prefix-shared (one row per example)::

    tokens:    [ prompt ........ ][ response 0 ..... ][ response 1 ...... ] ...
    positions:   0 ........ P-1     P ...... P+R0-1     P ....... P+R1-1      (restart after the prompt)
    branch:      0                  1                   2                     (0 = shared prompt)

Standard (K rows per example): `[prompt][response k]` for each k, branch 0 then 1, plain causal.

Every response token is predicted by the hidden state one step before it *in its own sequence*: the
first token of every response by the prompt's last position (no duplicated token), the others by the
previous token of the same response.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixdpo.data.example import Example


@dataclass(frozen=True)
class Row:
    """One sequence laid out for the model; all lists have the row's length n unless noted.

    input_ids, position_ids, branch_ids: [n]
    target_index:    [t] row position whose hidden state predicts each response token
    target_ids:      [t] the response tokens themselves
    target_response: [t] which response of the example (0..K-1) each target belongs to
    """

    input_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    branch_ids: tuple[int, ...]
    target_index: tuple[int, ...]
    target_ids: tuple[int, ...]
    target_response: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)


def _row(prompt: tuple[int, ...], responses: list[tuple[int, tuple[int, ...]]]) -> Row:
    """Lay out `prompt` followed by the given (response index, tokens), each restarting its positions."""
    p = len(prompt)
    input_ids = list(prompt)
    position_ids = list(range(p))
    branch_ids = [0] * p
    target_index: list[int] = []
    target_ids: list[int] = []
    target_response: list[int] = []
    for branch, (k, tokens) in enumerate(responses, start=1):
        start = len(input_ids)
        n = len(tokens)
        input_ids.extend(tokens)
        position_ids.extend(range(p, p + n))
        branch_ids.extend([branch] * n)
        # token 0 is predicted by the prompt's last position, token j>0 by token j-1 of this response
        target_index.append(p - 1)
        target_index.extend(range(start, start + n - 1))
        target_ids.extend(tokens)
        target_response.extend([k] * n)
    return Row(
        tuple(input_ids), tuple(position_ids), tuple(branch_ids),
        tuple(target_index), tuple(target_ids), tuple(target_response),
    )


def shared_row(example: Example) -> Row:
    """The prefix-shared row: prompt once, then every response (branch k+1 for response k)."""
    return _row(example.prompt_ids, list(enumerate(example.response_ids)))


def separate_rows(example: Example) -> list[Row]:
    """Standard layout: one causal `[prompt][response k]` row per response."""
    return [_row(example.prompt_ids, [(k, r)]) for k, r in enumerate(example.response_ids)]


def layout_example(example: Example, prefix_sharing: bool = True) -> list[Row]:
    """The rows of one example: [shared_row] with prefix sharing, else one row per response."""
    return [shared_row(example)] if prefix_sharing else separate_rows(example)
