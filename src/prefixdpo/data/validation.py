"""Record-level problems: one error type, one message format, and the error/skip policy that applies them.

Every problem with a user record becomes an `InvalidRecordError` whose message is one line,
`record 12: <problem>`, and which carries a short `reason` code (used to count skips by reason). The policy
`invalid="error"` raises the first one; `invalid="skip"` drops the record and counts it in a `SkipLog`, so no
record is ever lost without a count.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from prefixdpo.data.record_lines import TOO_BIG_ADVICE
from prefixdpo.errors import ConfigError, UserError

INVALID_POLICIES = ("error", "skip")

# Reason codes (the keys of `DataReport.skipped`).
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
EMPTY_PROMPT = "empty_prompt"
EMPTY_RESPONSE = "empty_response"
IDENTICAL_RESPONSES = "identical_responses"
PROMPT_MISMATCH = "prompt_mismatch"
NOT_UTF8 = "not_utf8"
SCORES_MISMATCH = "scores_mismatch"
NO_PREFERENCE = "no_preference"
BAD_JSON = "bad_json"
UNKNOWN_FORMAT = "unknown_format"
BOUNDARY = "boundary"
TOO_BIG = "too_big"  # a record over --max_record_bytes, left unparsed


class InvalidRecordError(UserError):
    """A user record that cannot become an `Example`. `str(err)` is `record <index>: <problem>`."""

    def __init__(self, index: int, reason: str, problem: str):
        self.index = index
        self.reason = reason
        self.problem = problem
        super().__init__(f"record {index}: {problem}")


@dataclass
class SkipLog:
    """Counts of skipped records by reason, with the first message of each reason as an example."""

    counts: Counter = field(default_factory=Counter)
    first_message: dict[str, str] = field(default_factory=dict)

    def add(self, err: InvalidRecordError) -> None:
        self.counts[err.reason] += 1
        self.first_message.setdefault(err.reason, str(err))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def check_policy(invalid: str) -> None:
    if invalid not in INVALID_POLICIES:
        raise ConfigError(f"invalid={invalid!r}: expected one of {INVALID_POLICIES}")


def handle(err: InvalidRecordError, invalid: str, log: SkipLog) -> None:
    """Apply the policy to one problem: raise it (`"error"`) or count it (`"skip"`)."""
    if invalid == "error":
        raise err
    log.add(err)


def text_bytes(value) -> int:
    """The UTF-8 bytes of every string (and bytes value) in a record, keys included, whatever holds them: its size
    as text, what tokenizing it costs memory by."""
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, dict):
        return sum(text_bytes(k) + text_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_bytes(v) for v in value)
    return 0


def check_record_size(index: int, record, limit: int) -> None:
    """An `InvalidRecordError` (`TOO_BIG`) for a record of more than `limit` bytes of text (0: no limit), before
    it is tokenized: the check of a record that no JSON Lines reader measured (CSV, Parquet, Arrow, in-memory
    datasets, the Hub); a JSON Lines record was measured as its line, which is never shorter than its text."""
    if limit and isinstance(record, dict):
        size = text_bytes(record)
        if size > limit:
            raise InvalidRecordError(index, TOO_BIG, f"holds {size} bytes of text, more than --max_record_bytes "
                                                     f"{limit} {TOO_BIG_ADVICE}")


# ---------------------------------------------------------------------------------------------- field checks


def _type_name(value) -> str:
    return "None" if value is None else type(value).__name__


def check_text(index: int, name: str, value) -> str:
    """A text field: a `str` that is valid Unicode (no lone surrogates). UTF-8 `bytes` are decoded."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidRecordError(index, NOT_UTF8, f"field '{name}' is not valid UTF-8 (byte {err.start})") from None
    if not isinstance(value, str):
        raise InvalidRecordError(index, WRONG_TYPE, f"field '{name}' must be a string, got {_type_name(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        # Lone surrogates come from mis-decoded bytes (e.g. `errors="surrogateescape"`) or from JSON `\ud800`.
        raise InvalidRecordError(
            index, NOT_UTF8, f"field '{name}' is not valid UTF-8 (lone surrogate at character {err.start})"
        ) from None
    return value


def check_messages(index: int, name: str, value) -> list[dict]:
    """A conversation: a list of `{"role": str, "content": str}` dicts. Returns clean copies of the messages
    (extra keys kept; keys whose value is None dropped, as `apply_chat_template` does)."""
    if not isinstance(value, (list, tuple)):
        raise InvalidRecordError(index, WRONG_TYPE, f"field '{name}' must be a list of messages, got {_type_name(value)}")
    out = []
    for k, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise InvalidRecordError(
                index, WRONG_TYPE, f"{name}[{k}] must be a message dict with 'role' and 'content', got {_type_name(msg)}"
            )
        for key in ("role", "content"):
            if key not in msg:
                raise InvalidRecordError(index, MISSING_FIELD, f"{name}[{k}] has no '{key}'")
        clean = {key: v for key, v in msg.items() if v is not None}
        clean["role"] = check_text(index, f"{name}[{k}].role", msg["role"])
        clean["content"] = check_text(index, f"{name}[{k}].content", msg["content"])
        out.append(clean)
    return out


def is_blank(value: str | list[dict]) -> bool:
    """Empty text, or a conversation with no message or only blank messages."""
    if isinstance(value, str):
        return not value.strip()
    return not value or all(not m["content"].strip() for m in value)


def check_scores(index: int, name: str, value, n: int) -> list[float]:
    """A list of `n` finite numbers (scores or ranks)."""
    if not isinstance(value, (list, tuple)):
        raise InvalidRecordError(index, WRONG_TYPE, f"field '{name}' must be a list of numbers, got {_type_name(value)}")
    if len(value) != n:
        raise InvalidRecordError(
            index, SCORES_MISMATCH, f"field '{name}' has {len(value)} entries but there are {n} completions"
        )
    out = []
    for k, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidRecordError(index, WRONG_TYPE, f"{name}[{k}] must be a number, got {_type_name(v)}")
        if not math.isfinite(v):
            raise InvalidRecordError(index, WRONG_TYPE, f"{name}[{k}] is {v}, expected a finite number")
        out.append(float(v))
    return out
