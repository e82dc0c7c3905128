"""Reward-model data: the DPO data pipeline's Examples (every format, pairs policy, validation,
truncation), each carrying the record's `margin` as TRL's `RewardTrainer` reads that column.

A record's margin (a finite number) applies to every preference pair of the record; a dataset without
the column has margin 0. A record whose margin is missing or not a number is bad input: an error naming
the record, or skipped and counted with `invalid="skip"`, as every other bad field.
"""

from __future__ import annotations

import dataclasses
import math

from prefixdpo.data.example import Example
from prefixdpo.data.validation import WRONG_TYPE, InvalidRecordError
from prefixdpo.data.inputs import as_examples
from prefixdpo.data.loader import MARGIN


def _margin(index: int, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRecordError(index, WRONG_TYPE, f"field 'margin' must be a finite number, got {value!r}")
    return float(value)


def _has_margin_column(records) -> bool:
    names = getattr(records, "column_names", None)
    if names is not None:  # a datasets.Dataset
        return MARGIN in names
    return any(isinstance(r, dict) and MARGIN in r for r in records)


def with_margins(examples: list[Example], records, report, invalid: str) -> list[Example]:
    """`examples` with `meta["margin"]` from their records (`records[ex.source_index]`); bad margins raise
    (invalid="error") or drop the example and count it in `report.skipped` (invalid="skip")."""
    if not _has_margin_column(records):
        return examples
    kept = []
    for ex in examples:
        try:
            margin = _margin(ex.source_index, records[ex.source_index].get(MARGIN))
        except InvalidRecordError as err:
            if invalid == "error":
                raise
            report.skipped[err.reason] += 1
            report.skip_examples.setdefault(err.reason, str(err))
            report.kept -= 1
            continue
        kept.append(dataclasses.replace(ex, meta={**ex.meta, MARGIN: margin}))
    return kept


def _examples_with_margins(data, tokenizer, options):
    """(Examples with their records' margins, data report) of records / a `datasets.Dataset` / a path."""
    from prefixdpo.data.loading import load_records
    from prefixdpo.data.prepare import examples_from_records

    records = load_records(data, options.split, options.dataset_config, options.max_samples,
                           options.max_record_bytes)
    examples, report = examples_from_records(records, tokenizer, options)
    return with_margins(examples, records, report, options.invalid), report


def reward_examples(data, tokenizer, options, name: str, reports: dict) -> list[Example] | None:
    """`data` as Examples with margins (None stays None; Examples are used as they are, `meta["margin"]`
    if set); the data report goes to `reports[name]`."""
    return as_examples(data, tokenizer, options, name, reports, prepare=_examples_with_margins)
