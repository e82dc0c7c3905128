"""`Example`: one tokenized preference record, the unit every later stage works on."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixdpo.errors import UserError


@dataclass(frozen=True)
class Example:
    """A prompt, K >= 2 responses to it, and which responses are preferred to which.

    prompt_ids:   token ids of the shared prompt (non-empty: its last hidden state predicts
                  the first token of every response).
    response_ids: K lists of token ids, one per response (each non-empty).
    pairs:        (i, j) = response i is preferred to response j; indices into `response_ids`.
    source_index: index of the record this came from (for messages and reports); -1 if synthetic.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[int, int], ...] = ((0, 1),)
    source_index: int = -1
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Normalise to tuples so examples are hashable and cannot be mutated by a later stage.
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "response_ids", tuple(tuple(int(t) for t in r) for r in self.response_ids))
        object.__setattr__(self, "pairs", tuple((int(i), int(j)) for i, j in self.pairs))
        if not self.prompt_ids:
            raise UserError(f"record {self.source_index}: empty prompt")
        if len(self.response_ids) < 2:
            raise UserError(f"record {self.source_index}: needs at least 2 responses, got {len(self.response_ids)}")
        for k, r in enumerate(self.response_ids):
            if not r:
                raise UserError(f"record {self.source_index}: response {k} is empty")
        for i, j in self.pairs:
            if not (0 <= i < len(self.response_ids) and 0 <= j < len(self.response_ids)) or i == j:
                raise UserError(f"record {self.source_index}: bad preference pair ({i}, {j})")

    @property
    def num_responses(self) -> int:
        return len(self.response_ids)

    @property
    def shared_length(self) -> int:
        """Tokens in the prefix-shared row: prompt once, then every response."""
        return len(self.prompt_ids) + sum(len(r) for r in self.response_ids)

    @property
    def unshared_length(self) -> int:
        """Tokens standard DPO runs: the prompt repeated for every response."""
        return sum(len(self.prompt_ids) + len(r) for r in self.response_ids)
