"""`max_length` with TRL 1.16's meaning: each `[prompt][response k]` sequence within `max_length` tokens.

TRL 1.16's `DPOTrainer` has no prompt or completion limit of its own (no `max_prompt_length`, no
`max_completion_length`): its collator cuts each standard sequence `prompt + response` to `max_length`,
`keep_start` (the default) keeping its first tokens, `keep_end` (deprecated in TRL) its last; and with
`keep_start` it drops, at tokenization, every example whose prompt alone has `max_length` tokens or more.
The prefix-shared row (prompt once + all K responses) is therefore NOT limited by `max_length`: it holds
K sequences of at most `max_length` tokens each and may be longer (packing follows the row lengths).

Prefix sharing needs ONE prompt for all responses of a row, while TRL cuts each sequence on its own. Our
choice, per mode (with `overlong="truncate"`, the default):

- `keep_start`: TRL never cuts the prompt here, so every sequence equals TRL's exactly: a prompt of
  `max_length` tokens or more drops the example (as TRL's filter), otherwise response k keeps its first
  `max_length - P` tokens.
- `keep_end`: TRL cuts each sequence's prompt from the left by what that sequence is over. The shared
  prompt is cut by the most any sequence needs, so the LONGEST sequence equals TRL's and every shorter one
  is a suffix of TRL's (the same response after fewer prompt tokens). When a response alone has
  `max_length` tokens or more (TRL's sequence is then its last `max_length` tokens, no prompt), the row
  keeps the prompt's last token and that response's last `max_length - 1` tokens: the response tokens
  whose log-probs count are TRL's (TRL never scores a sequence's first token); only the one token of
  context before them differs. `max_length` 1 leaves nothing to score: the example is dropped.

`overlong="drop"` (ours; TRL has no such option) drops every example with a sequence over `max_length`.
Dropped examples are counted by the caller, with the reason this module gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixdpo.errors import ConfigError

TRUNCATION_MODES = ("keep_start", "keep_end")
OVERLONG_POLICIES = ("truncate", "drop")


@dataclass(frozen=True)
class Limited:
    """One example after the length rule.

    prompt: P' token ids; responses: K lists of token ids (each P' + R_k' <= max_length unless dropped).
    status: "kept" (untouched), "truncated" or "dropped"; problem: why it was dropped ("" otherwise).
    """

    prompt: list[int]
    responses: list[list[int]]
    status: str
    problem: str = ""


def truncate_row(
    prompt: list[int],
    responses: list[list[int]],
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    overlong: str = "truncate",
) -> Limited:
    """Apply `max_length` to every `[prompt][response k]` sequence of one example (see module docstring).

    prompt: P ids (P >= 1); responses: K lists of ids (each non-empty).
    """
    if truncation_mode not in TRUNCATION_MODES:
        raise ConfigError(f"truncation_mode={truncation_mode!r}: expected one of {TRUNCATION_MODES}")
    if overlong not in OVERLONG_POLICIES:
        raise ConfigError(f"overlong={overlong!r}: expected one of {OVERLONG_POLICIES}")
    if max_length is None:
        return Limited(prompt, responses, "kept")
    p = len(prompt)
    longest = max(range(len(responses)), key=lambda k: len(responses[k]))
    over = p + len(responses[longest]) - max_length  # tokens the longest sequence is over the limit
    if truncation_mode == "keep_start" and p >= max_length:
        # TRL's filter, applied whatever `overlong` says: no response token would be left.
        return Limited(prompt, responses, "dropped", f"prompt of {p} tokens leaves no room within max_length {max_length}")
    if over <= 0:
        return Limited(prompt, responses, "kept")
    if overlong == "drop":
        return Limited(
            prompt, responses, "dropped",
            f"prompt + response {longest} is {p + len(responses[longest])} tokens, over max_length {max_length}",
        )
    if truncation_mode == "keep_start":
        return Limited(prompt, [r[: max_length - p] for r in responses], "truncated")
    if over < p:
        return Limited(prompt[over:], responses, "truncated")
    if max_length < 2:
        return Limited(prompt, responses, "dropped", "max_length 1 leaves no response token to score")
    return Limited(prompt[-1:], [r[-(max_length - 1):] for r in responses], "truncated")
