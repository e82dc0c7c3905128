"""What the trainer is given -> what its loaders need: Examples (the loader settings of a run are built from its
config in `training.settings`).

A dataset may be a list of `Example`s (used as is), or records / a `datasets.Dataset` / a path, which go
through the data pipeline (`data.prepare.prepare_examples`) with the tokenizer.
"""

from __future__ import annotations

from prefixdpo.data.example import Example
from prefixdpo.errors import UserError


def is_examples(data) -> bool:
    return isinstance(data, (list, tuple)) and len(data) > 0 and all(isinstance(x, Example) for x in data)


def prepared_examples(data, tokenizer, options):
    """(Examples, data report) of records / a `datasets.Dataset` / a path, through the data pipeline."""
    from prefixdpo.data.prepare import prepare_examples

    prepared = prepare_examples(data, tokenizer, options)
    return prepared.examples, prepared.report


def as_examples(data, tokenizer, options, name: str, reports: dict, prepare=prepared_examples) -> list[Example] | None:
    """`data` as Examples (None stays None); the data report is stored in `reports[name]`.

    prepare: (data, tokenizer, options) -> (Examples, report), for records (the reward trainer's adds margins).
    """
    if data is None:
        return None
    if is_examples(data):
        return list(data)
    if isinstance(data, (list, tuple)) and not data:
        raise UserError(f"{name} dataset is empty")
    if tokenizer is None:
        raise UserError(f"{name} dataset holds records, not Examples: pass processing_class (a tokenizer)")
    examples, report = prepare(data, tokenizer, options)
    reports[name] = report
    if not examples:
        raise UserError(f"{name} dataset: no usable examples ({report.summary()})")
    return examples


def pad_token_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None) if tokenizer is not None else None
        if isinstance(value, int):
            return value
    return 0  # any id works: padding is masked out and never a target
