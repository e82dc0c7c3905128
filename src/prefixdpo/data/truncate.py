"""Length limits on the whole prefix-shared row (prompt once + all K responses), not per pair.

`max_prompt_length` caps the prompt; `max_length` caps the row `P + sum_k R_k`. With `overlong="truncate"`:

1. A prompt over `max_prompt_length` is cut: `keep_end` (default) drops its start (the tokens nearest the
   responses are the ones that matter), `keep_start` drops its end.
2. A row still over `max_length`:
   - `keep_end`: the prompt yields first, from the left, but keeps at least `max_length // 2` tokens;
   - `keep_start`: the prompt is kept whole;
   then the responses are cut from the right to one common cap `c`, the largest with
   `P + sum_k min(R_k, c) <= max_length` (short responses stay whole; the long ones share what is left).
3. If that leaves a response no token, the example is dropped (and counted): its prompt fills the row.

With `overlong="drop"` any example over either limit is dropped and counted instead.
"""

from __future__ import annotations

TRUNCATION_MODES = ("keep_end", "keep_start")
OVERLONG_POLICIES = ("truncate", "drop")


def _cut_prompt(prompt: list[int], n: int, mode: str) -> list[int]:
    if len(prompt) <= n:
        return prompt
    return prompt[len(prompt) - n :] if mode == "keep_end" else prompt[:n]


def _common_cap(lengths: list[int], budget: int) -> int:
    """Largest c with sum(min(l, c)) <= budget (0 if even c = 1 does not fit)."""
    lo, hi = 0, max(lengths)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in lengths) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def truncate_row(
    prompt: list[int],
    responses: list[list[int]],
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    truncation_mode: str = "keep_end",
    overlong: str = "truncate",
) -> tuple[list[int], list[list[int]], str] | None:
    """Apply the limits to one row. Returns (prompt, responses, status) with status "kept" or "truncated",
    or None if the example must be dropped (the caller counts it)."""
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode={truncation_mode!r}: expected one of {TRUNCATION_MODES}")
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={overlong!r}: expected one of {OVERLONG_POLICIES}")
    row = len(prompt) + sum(len(r) for r in responses)
    prompt_over = max_prompt_length is not None and len(prompt) > max_prompt_length
    row_over = max_length is not None and row > max_length
    if not (prompt_over or row_over):
        return prompt, responses, "kept"
    if overlong == "drop":
        return None
    if prompt_over:
        prompt = _cut_prompt(prompt, max_prompt_length, truncation_mode)
    if max_length is not None and len(prompt) + sum(len(r) for r in responses) > max_length:
        if truncation_mode == "keep_end":
            room = max_length - sum(len(r) for r in responses)  # prompt tokens that fit beside whole responses
            prompt = _cut_prompt(prompt, max(room, max_length // 2), truncation_mode)
        cap = _common_cap([len(r) for r in responses], max_length - len(prompt))
        if cap < 1:
            return None
        responses = [r[:cap] for r in responses]
    return prompt, responses, "truncated"
