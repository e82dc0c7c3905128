"""User records (the formats TRL's DPOTrainer accepts, plus multi-response) -> `ParsedRecord`, validated.

Formats, detected per record from its fields:

- standard:        {"prompt": str, "chosen": str, "rejected": str}
- conversational:  {"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant messages]}
- implicit prompt: {"chosen": [messages], "rejected": [messages]}; the prompt is their longest common run of
                   leading messages (as TRL's `extract_prompt`). Plain-string implicit records are refused:
                   where a string prompt ends is a guess (TRL guesses at the first differing character).
- multi-response:  {"prompt": str | [messages], "completions": [str | [messages], ...], "scores" | "ranks": [...]}
                   (higher score = better; rank 1 = best). `pairs_policy` turns the order into pairs.

A message is `{"role": str, "content": str}`. As in TRL, a string `prompt` next to conversational
`chosen`/`rejected` is ignored and the prompt extracted from the conversations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations

from prefixdpo.data.validation import (
    EMPTY_PROMPT,
    EMPTY_RESPONSE,
    IDENTICAL_RESPONSES,
    MISSING_FIELD,
    NO_PREFERENCE,
    PROMPT_MISMATCH,
    UNKNOWN_FORMAT,
    WRONG_TYPE,
    InvalidRecordError,
    check_messages,
    check_scores,
    check_text,
    is_blank,
)
from prefixdpo.errors import ConfigError

PAIRS_POLICIES = ("best_vs_worst", "best_vs_each", "all_pairs")
IMPLICIT_TEXT = "implicit_text"


@dataclass
class ParsedRecord:
    """A validated record, still as text. `kind` is "text" (strings) or "chat" (message lists).

    responses: K >= 2 responses, each a string or a list of messages (the turns after the prompt).
    pairs:     (i, j) = response i preferred to response j.
    unused:    responses of a multi-response record left out because no pair of the policy uses them.
    """

    index: int
    format: str  # "standard" | "conversational" | "implicit" | "multi_response"
    kind: str  # "text" | "chat"
    prompt: str | list[dict]
    responses: list
    pairs: list[tuple[int, int]]
    scores: list[float] | None = None
    unused: int = 0
    meta: dict = field(default_factory=dict)


def _present(record: dict, key: str) -> bool:
    # Columnar loaders (Arrow) fill a field missing from one record with None: None does not decide the format.
    return record.get(key) is not None


def _missing(index: int, record: dict, keys: tuple[str, ...], problem: str) -> InvalidRecordError:
    """The error for required fields none of which has a value: null ones are named as null (the data holds
    a null there), else `problem` says what is missing."""
    nulls = [k for k in keys if k in record]
    if not nulls:
        return InvalidRecordError(index, MISSING_FIELD, problem)
    if len(nulls) == 1:
        return InvalidRecordError(index, WRONG_TYPE, f"field '{nulls[0]}' is null (None)")
    names = " and ".join(f"'{k}'" for k in nulls)
    return InvalidRecordError(index, WRONG_TYPE, f"fields {names} are null (None)")


def _value(index: int, name: str, value):
    """A text or conversational field, checked; returns (kind, value)."""
    if isinstance(value, (list, tuple)):
        return "chat", check_messages(index, name, value)
    return "text", check_text(index, name, value)


def _same_kind(index: int, kinds: dict[str, str]) -> str:
    distinct = set(kinds.values())
    if len(distinct) > 1:
        chat = [k for k, v in kinds.items() if v == "chat"]
        text = [k for k, v in kinds.items() if v == "text"]
        raise InvalidRecordError(
            index, WRONG_TYPE, f"{', '.join(chat)} {'is a conversation' if len(chat) == 1 else 'are conversations'} "
            f"but {', '.join(text)} {'is a string' if len(text) == 1 else 'are strings'}: use one form for all fields"
        )
    return distinct.pop()


def _check_non_empty(index: int, prompt, responses: list, names: list[str]) -> None:
    if is_blank(prompt):
        raise InvalidRecordError(index, EMPTY_PROMPT, "prompt is empty")
    for name, r in zip(names, responses):
        if is_blank(r):
            raise InvalidRecordError(index, EMPTY_RESPONSE, f"{name} is empty")


def _split_implicit(index: int, chosen: list[dict], rejected: list[dict]):
    """Longest common run of leading messages = the prompt; the rest of each conversation = the response."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == len(chosen) and n == len(rejected):
        raise InvalidRecordError(index, IDENTICAL_RESPONSES, "chosen and rejected are identical")
    if n == 0:
        raise InvalidRecordError(
            index, PROMPT_MISMATCH, "chosen and rejected share no leading message, so they have no common prompt"
        )
    for name, conv in (("chosen", chosen), ("rejected", rejected)):
        if n == len(conv):
            raise InvalidRecordError(index, EMPTY_RESPONSE, f"{name} has no message after the shared prompt")
        if conv[n]["role"] != "assistant":
            # The conversations diverge on a non-assistant turn: the prompts differ, not just the answers.
            raise InvalidRecordError(
                index, PROMPT_MISMATCH,
                f"chosen and rejected differ at message {n}, a '{conv[n]['role']}' message: their prompts differ",
            )
    return chosen[:n], [chosen[n:], rejected[n:]]


def preference_pairs(scores: list[float], policy: str) -> list[tuple[int, int]]:
    """Pairs (better, worse) from per-response scores (higher = better); ties give no pair.

    best_vs_worst: one pair, the first best against the last worst.
    best_vs_each:  the first best against every strictly worse response.
    all_pairs:     every (i, j) with scores[i] > scores[j].
    """
    if policy not in PAIRS_POLICIES:
        raise ConfigError(f"pairs_policy={policy!r}: expected one of {PAIRS_POLICIES}")
    best = max(range(len(scores)), key=lambda k: (scores[k], -k))
    if policy == "best_vs_worst":
        worst = min(range(len(scores)), key=lambda k: (scores[k], -k))
        return [(best, worst)] if scores[best] > scores[worst] else []
    if policy == "best_vs_each":
        return [(best, k) for k in range(len(scores)) if scores[k] < scores[best]]
    pairs = []
    for i, j in combinations(range(len(scores)), 2):
        if scores[i] != scores[j]:
            pairs.append((i, j) if scores[i] > scores[j] else (j, i))
    return pairs


def _parse_multi(index: int, record: dict, pairs_policy: str) -> ParsedRecord:
    if not _present(record, "prompt"):
        raise _missing(index, record, ("prompt",), "missing field 'prompt' (required with 'completions')")
    has_scores, has_ranks = _present(record, "scores"), _present(record, "ranks")
    if has_scores and has_ranks:
        raise InvalidRecordError(index, WRONG_TYPE, "has both 'scores' and 'ranks'")
    if not (has_scores or has_ranks):
        raise _missing(index, record, ("scores", "ranks"), "missing field 'scores' or 'ranks'")
    completions = record["completions"]
    if not isinstance(completions, (list, tuple)):
        raise InvalidRecordError(index, WRONG_TYPE, f"field 'completions' must be a list, got {type(completions).__name__}")
    if len(completions) < 2:
        raise InvalidRecordError(index, NO_PREFERENCE, f"needs at least 2 completions, got {len(completions)}")
    kinds = {}
    kinds["prompt"], prompt = _value(index, "prompt", record["prompt"])
    responses = []
    for k, c in enumerate(completions):
        kinds[f"completions[{k}]"], value = _value(index, f"completions[{k}]", c)
        responses.append(value)
    kind = _same_kind(index, kinds)
    _check_non_empty(index, prompt, responses, [f"completions[{k}]" for k in range(len(responses))])
    if has_scores:
        scores = check_scores(index, "scores", record["scores"], len(responses))
    else:
        scores = [-r for r in check_scores(index, "ranks", record["ranks"], len(responses))]  # rank 1 = best
    pairs = preference_pairs(scores, pairs_policy)
    if not pairs:
        raise InvalidRecordError(index, NO_PREFERENCE, "all completions are tied, so there is no preference")
    for i, j in pairs:
        if responses[i] == responses[j]:
            raise InvalidRecordError(
                index, IDENTICAL_RESPONSES, f"completions {min(i, j)} and {max(i, j)} are identical but ranked differently"
            )
    # Keep only the responses some pair uses; they all go into ONE example (one row, prompt once).
    used = sorted({k for p in pairs for k in p})
    remap = {old: new for new, old in enumerate(used)}
    return ParsedRecord(
        index=index, format="multi_response", kind=kind, prompt=prompt,
        responses=[responses[k] for k in used], pairs=[(remap[i], remap[j]) for i, j in pairs],
        scores=[scores[k] for k in used], unused=len(responses) - len(used),
        meta={"completion_indices": used},
    )


def parse_record(index: int, record, pairs_policy: str = "best_vs_worst") -> ParsedRecord:
    """Validate one record and bring it to a `ParsedRecord`; raises `InvalidRecordError` naming the problem."""
    if isinstance(record, InvalidRecordError):  # a loader could not even read it (bad JSON, bad bytes)
        raise record
    if not isinstance(record, dict):
        raise InvalidRecordError(index, WRONG_TYPE, f"record must be a mapping of fields, got {type(record).__name__}")
    if _present(record, "completions"):
        return _parse_multi(index, record, pairs_policy)
    if not (_present(record, "chosen") or _present(record, "rejected")):
        if _present(record, "prompt") or "chosen" in record or "rejected" in record:
            raise _missing(
                index, record, ("chosen", "rejected"),
                "missing fields 'chosen' and 'rejected' (or 'completions' with 'scores'/'ranks')",
            )
        raise InvalidRecordError(
            index, UNKNOWN_FORMAT,
            f"no preference fields (found {sorted(record)}); expected prompt/chosen/rejected, chosen/rejected, "
            "or prompt/completions/scores|ranks",
        )
    for name in ("chosen", "rejected"):
        if not _present(record, name):
            raise _missing(index, record, (name,), f"missing field '{name}'")
    kinds = {}
    kinds["chosen"], chosen = _value(index, "chosen", record["chosen"])
    kinds["rejected"], rejected = _value(index, "rejected", record["rejected"])
    kind = _same_kind(index, kinds)
    # A string prompt beside conversations is ignored, as in TRL's `maybe_extract_prompt`.
    explicit = _present(record, "prompt") and not (
        kind == "chat" and isinstance(record["prompt"], (str, bytes))
    )
    if explicit:
        kinds["prompt"], prompt = _value(index, "prompt", record["prompt"])
        kind = _same_kind(index, kinds)
        _check_non_empty(index, prompt, [chosen, rejected], ["chosen", "rejected"])
        if chosen == rejected:
            raise InvalidRecordError(index, IDENTICAL_RESPONSES, "chosen and rejected are identical")
        fmt = "conversational" if kind == "chat" else "standard"
        return ParsedRecord(index, fmt, kind, prompt, [chosen, rejected], [(0, 1)])
    if kind == "text":
        no_prompt = "and field 'prompt' is null (None)" if "prompt" in record else "with no 'prompt' field"
        raise InvalidRecordError(
            index, IMPLICIT_TEXT,
            f"chosen and rejected are strings {no_prompt}: where the prompt ends is ambiguous; add a 'prompt'",
        )
    prompt, responses = _split_implicit(index, chosen, rejected)
    _check_non_empty(index, prompt, responses, ["chosen", "rejected"])
    return ParsedRecord(index, "implicit", kind, prompt, responses, [(0, 1)])
