"""Prompt-only records for GRPO / RLOO: read as `prefixdpo train` reads records (`data.loading.load_records`:
JSON Lines, JSON, Parquet, CSV, `save_to_disk` folders, in-memory datasets, Hub names), checked one by one, and
handed to TRL as a `datasets.Dataset`.

A record is a dict with a `prompt`: text, or a conversation (a list of `{"role", "content"}` messages, which TRL
renders with the tokenizer's chat template). Every other field is kept: TRL passes it to the reward functions
(e.g. `solution` for `accuracy_reward`). A bad record stops the run with one line naming it (`invalid="error"`)
or is skipped and counted (`invalid="skip"`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixdpo.data.validation import (

    EMPTY_PROMPT, MISSING_FIELD, WRONG_TYPE, InvalidRecordError, SkipLog, check_messages, check_policy,
    check_record_size, check_text, handle, is_blank,

)

from prefixdpo.errors import UserError

from prefixdpo.data.loading import load_records
from prefixdpo.data.record_lines import DEFAULT_MAX_RECORD_BYTES, check_max_record_bytes


@dataclass
class PromptReport:
    """What loading kept: `loaded` records, `kept` prompts (`kept_indices`: the source index of each), the rest
    skipped by reason."""

    loaded: int = 0
    kept: int = 0
    kept_indices: list[int] = field(default_factory=list)
    skipped: SkipLog = field(default_factory=SkipLog)

    def summary(self) -> str:
        text = f"Loaded {self.loaded} records, kept {self.kept} prompts."
        if self.skipped.total:
            reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.skipped.counts.items()))
            first = next(iter(sorted(self.skipped.first_message.items())))[1]
            text += f" Skipped {self.skipped.total} invalid ({reasons}; e.g. {first})."
        return text


def checked_prompt_record(index: int, record) -> dict:
    """The record with its prompt checked (text, or messages with text roles and contents), or
    `InvalidRecordError` naming record `index` and the problem."""
    if isinstance(record, InvalidRecordError):  # a line the reader could not parse
        raise record
    if not isinstance(record, dict):
        raise InvalidRecordError(index, WRONG_TYPE, f"expected an object with a 'prompt', got {type(record).__name__}")
    if "prompt" not in record:
        fields = ", ".join(sorted(map(str, record))) or "none"
        raise InvalidRecordError(index, MISSING_FIELD, f"no 'prompt' field (fields: {fields})")
    value = record["prompt"]
    if isinstance(value, (str, bytes)):
        prompt = check_text(index, "prompt", value)
    else:
        prompt = check_messages(index, "prompt", value)
    if is_blank(prompt):
        raise InvalidRecordError(index, EMPTY_PROMPT, "empty prompt")
    return {**record, "prompt": prompt}


def load_prompts(source, *, split: str | None = "train", dataset_config: str | None = None,
                 max_samples: int | None = None, invalid: str = "error",
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES):
    """(`datasets.Dataset` of the checked records, `PromptReport`) of one split of `source` (max_record_bytes: the
    most bytes of one record, 0: no limit; a larger one is a bad record, as in `prepare.DataOptions`)."""
    from datasets import Dataset

    check_policy(invalid)
    check_max_record_bytes(max_record_bytes)
    records = load_records(source, split=split, dataset_config=dataset_config, max_samples=max_samples,
                           max_record_bytes=max_record_bytes)
    report = PromptReport(loaded=len(records))
    kept = []
    for index in range(len(records)):
        try:
            record = records[index]
            check_record_size(index, record, max_record_bytes)
            kept.append(checked_prompt_record(index, record))
            report.kept_indices.append(index)
        except InvalidRecordError as err:
            handle(err, invalid, report.skipped)
    report.kept = len(kept)
    if not kept:
        raise UserError(f"no usable prompts in {source} ({report.summary()})")
    try:
        return Dataset.from_list(kept), report
    except (TypeError, ValueError) as err:  # pyarrow's ArrowInvalid / ArrowTypeError derive from these
        raise UserError(f"{source}: the records' fields do not have one type each "
                        f"(e.g. text prompts mixed with message lists): {' '.join(str(err).split())}") from None
