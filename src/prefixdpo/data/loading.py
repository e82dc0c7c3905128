"""Where records come from: local files, a `save_to_disk` directory, in-memory datasets, or the Hub.

`load_records(source, split=...)` returns an indexable sequence of records (dicts), record i being the
i-th row of the split, so every later message can name it.

- `.json` / `.jsonl` files are read with Python's `json`, one record per line (or a top-level list), not
  through Arrow: Arrow would coerce types across records, turn a missing field into None and fail the whole
  file on one bad line. Here a bad line becomes an `InvalidRecordError` for that record index (bad JSON,
  invalid UTF-8), which the error/skip policy then handles.
- `.parquet` / `.csv` files and directories of such files: `datasets.load_dataset(<builder>, data_files=...)`.
- A directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`: `datasets.load_from_disk`.
- `datasets.Dataset`, `datasets.DatasetDict`, or a list of dicts: used as they are.
- Any other string: a Hub dataset name, `datasets.load_dataset(name, dataset_config, split=split)`.
- A dict {split name: any of the above}: one source per split.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from prefixdpo.data.validation import BAD_JSON, NOT_UTF8, InvalidRecordError
from prefixdpo.errors import ConfigError, UserError

class DatasetNotFoundError(UserError, FileNotFoundError):
    """A dataset path that does not exist: a user error (one line), still a `FileNotFoundError` to catch."""


_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
_LOCAL_HINTS = (os.sep, "./", "../", "~")


def read_json_records(path: str | Path) -> list:
    """Records of a JSON Lines file (or a JSON file holding one list). A line that is not valid UTF-8 or not
    valid JSON becomes an `InvalidRecordError` in its place, so record numbering never shifts."""
    data = Path(path).read_bytes()
    head = data.lstrip()[:1]
    if head == b"[":  # one JSON array: all or nothing, as the format gives no line to blame
        try:
            records = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise UserError(f"{path}: not valid UTF-8 at byte {err.start}") from None
        except json.JSONDecodeError as err:
            raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
        if not isinstance(records, list):
            raise UserError(f"{path}: expected JSON Lines or a JSON list of records, got a {type(records).__name__}")
        return records
    records: list = []
    for line_no, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue  # blank lines are not records
        index = len(records)
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            records.append(InvalidRecordError(index, NOT_UTF8, f"line {line_no} is not valid UTF-8 (byte {err.start})"))
            continue
        try:
            records.append(json.loads(text))
        except json.JSONDecodeError as err:
            records.append(InvalidRecordError(index, BAD_JSON, f"line {line_no} is not valid JSON ({err.msg})"))
    return records


def _splits(obj) -> list[str] | None:
    """Split names of a DatasetDict, or None for a single split."""
    import datasets

    if isinstance(obj, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return list(obj)
    return None


def _pick_split(obj, split: str | None, source_name: str):
    names = _splits(obj)
    if names is None:
        return obj
    if split is None:
        split = "train"
    if split not in names:
        raise UserError(f"{source_name}: no split {split!r} (available: {', '.join(names)})")
    return obj[split]


def _local_path(source: str) -> Path | None:
    path = Path(source).expanduser()
    if path.exists():
        return path
    if source.startswith(_LOCAL_HINTS) or Path(source).suffix.lower() in _BUILDERS:
        raise DatasetNotFoundError(f"no such file or directory: {source}")
    return None  # not a local path: a Hub name


def _load_path(path: Path, split: str | None):
    import datasets

    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return _pick_split(datasets.load_from_disk(str(path)), split, str(path))
        return _pick_split(datasets.load_dataset(str(path)), split, str(path))  # a folder of data files
    suffix = path.suffix.lower()
    if split not in (None, "train"):
        raise UserError(f"{path}: a single file has only the split 'train', not {split!r}")
    if suffix in (".json", ".jsonl"):
        return read_json_records(path)
    if suffix not in _BUILDERS:
        raise UserError(f"{path}: unknown file type {suffix!r} (expected .jsonl, .json, .parquet, .csv or .arrow)")
    return datasets.load_dataset(_BUILDERS[suffix], data_files=str(path), split="train")


def load_records(
    source,
    split: str | None = "train",
    dataset_config: str | None = None,
    max_samples: int | None = None,
) -> Sequence:
    """The records of one split of `source` (see module docstring), the first `max_samples` of them if set.

    Returns a `datasets.Dataset` or a list; either way `len()` and `[i]` give record i as a dict.
    """
    if max_samples is not None and max_samples < 0:
        raise ConfigError(f"max_samples must be >= 0, got {max_samples}")
    if isinstance(source, dict) and _splits(source) is None and not _looks_like_record(source):  # {split: source}
        name = split or "train"
        if name not in source:
            raise UserError(f"no split {name!r} (available: {', '.join(source)})")
        return load_records(source[name], split=None, dataset_config=dataset_config, max_samples=max_samples)
    if isinstance(source, (str, Path)):
        path = _local_path(str(source))
        if path is not None:
            records = _load_path(path, split)
        else:
            import datasets

            records = datasets.load_dataset(str(source), dataset_config, split=split or "train")
    elif isinstance(source, list):
        records = source
    else:
        records = _pick_split(source, split, type(source).__name__)
    if max_samples is not None and max_samples < len(records):
        records = records.select(range(max_samples)) if hasattr(records, "select") else records[:max_samples]
    return records


def _looks_like_record(obj: dict) -> bool:
    return any(k in obj for k in ("prompt", "chosen", "rejected", "completions"))
