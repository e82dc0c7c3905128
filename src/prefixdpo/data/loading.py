"""Where records come from: local files, a `save_to_disk` directory, in-memory datasets, or the Hub.

`load_records(source, split=...)` returns an indexable sequence of records (dicts), record i being the
i-th row of the split, so every later message can name it.

- `.json` / `.jsonl` files are read with Python's `json`, one record per line (or a top-level list), not
  through Arrow: Arrow would coerce types across records, turn a missing field into None and fail the whole
  file on one bad line. Here a bad line becomes an `InvalidRecordError` for that record index (bad JSON,
  invalid UTF-8, more than `max_record_bytes`), which the error/skip policy then handles. JSON Lines are read
  line by line in bounded memory (`record_lines`): a line over the limit is never held whole.
- `.parquet` / `.csv` / `.arrow` files: `datasets.load_dataset(<builder>, data_files=...)`; a file it cannot
  read is a `UserError` naming the file and the reader's reason (a CSV row with extra fields names its line).
- A folder of data files, split by file name as `datasets.load_dataset(folder)` splits it (`train*.jsonl`,
  `test*.jsonl`, ...; everything in `train` when no name says a split). Its files must be of one type, as
  `datasets` reads a folder with one builder: a folder of `a.jsonl` and `b.csv` would be read as JSON with
  the CSV silently left out, so it is refused, naming every type and its files. Why refuse rather than read
  both: `datasets` has no cross-type folder, CSV columns cannot hold conversations, and record numbers over
  mixed readers would name nothing a user can find. Every file of the folder is read in a split, or the folder
  is refused naming the ones left out (`folder`: `train.jsonl` + `more.jsonl` would read only `train.jsonl`),
  except files that are clearly no data (hidden ones, README*, LICENSE*). JSON(L) folders are read by the same
  reader as a JSON(L) file, the files of a split one after another (record numbers run on across them), and a
  bad line names its file and line (`record 19: a.jsonl line 20 is not valid JSON`).
- A directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`: `datasets.load_from_disk`.
- `datasets.Dataset`, `datasets.DatasetDict`, or a list of dicts: used as they are.
- Any other string: a Hub dataset name, `datasets.load_dataset(name, dataset_config, split=split)`.
- A dict {split name: any of the above}: one source per split.
- A streamed dataset (`datasets.IterableDataset` / `IterableDatasetDict`) is refused in one line
  (`STREAMING_REFUSED` says why), never read whole behind the user's back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from prefixdpo.data.folder import BUILDERS, EXPECTED, data_files
from prefixdpo.data.record_lines import (
    DEFAULT_MAX_RECORD_BYTES, OversizedLine, bounded_lines, first_byte, too_big_problem,
)
from prefixdpo.data.validation import BAD_JSON, NOT_UTF8, TOO_BIG, InvalidRecordError
from prefixdpo.errors import ConfigError, UserError

class DatasetNotFoundError(UserError, FileNotFoundError):
    """A dataset path that does not exist: a user error (one line), still a `FileNotFoundError` to catch."""


# Why a streamed dataset cannot train here (the data pipeline, the trainers and `--dataset_streaming` say it).
STREAMING_REFUSED = (
    "prefixdpo plans each epoch's micro-batches from every example's length before the first step (packing, "
    "the same number of micro-batches on every rank, the pairs of each optimizer step), so it needs the whole "
    "split, and a streamed one is not read whole behind your back: load it without streaming (datasets caches "
    "it on disk)")

_LOCAL_HINTS = (os.sep, "./", "../", "~")


def read_tab_groups(path: str, what: str = "responses") -> list[tuple[str, list[str]]]:
    """(prompt, [text, ...]) per line of a file of lines 'prompt<TAB>text<TAB>text...' (`verify --text_file`):
    a line with fewer than 2 `what` or a file without lines is a one-line `UserError` naming it."""
    groups = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh):
            parts = [x for x in line.rstrip("\n").split("\t") if x]
            if len(parts) < 3:
                raise UserError(f"{path} line {n + 1}: needs a prompt and at least 2 {what}, tab-separated")
            groups.append((parts[0], parts[1:]))
    if not groups:
        raise UserError(f"{path}: no groups")
    return groups


def read_json_records(path: str | Path, *, first_index: int = 0, where: str = "",
                      max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> list:
    """Records of a JSON Lines file (or a JSON file holding one list). A line that is not valid UTF-8 or not
    valid JSON, or holds more than `max_record_bytes` bytes (0: no limit), becomes an `InvalidRecordError` in its
    place, so record numbering never shifts; a line over the limit is never held whole (`record_lines`). A JSON
    list is read whole; its records are sized by their text, as any other source's (`check_record_size`).

    first_index: the record number of this file's first record (a folder's files are numbered on).
    where: put before "line N" in a bad line's message (a folder's file name, so the message names the file).
    """
    with open(path, "rb") as fh:
        if first_byte(fh) == b"[":  # one JSON array: read whole, as the format gives no line to cut it at
            return _json_array(path, fh.read())
        records: list = []
        for line_no, line in bounded_lines(fh, max_record_bytes):
            index = first_index + len(records)
            if isinstance(line, OversizedLine):
                problem = too_big_problem(where or f"{path} ", line_no, line, max_record_bytes)
                records.append(InvalidRecordError(index, TOO_BIG, problem))
                continue
            if not line.strip():
                continue  # blank lines are not records
            records.append(_json_line(line, index, f"{where}line {line_no}"))
    return records


def _json_line(line: bytes, index: int, where: str):
    """The record of one JSON line, or an `InvalidRecordError` for record `index` (`where`: "FILE line N")."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return InvalidRecordError(index, NOT_UTF8, f"{where} is not valid UTF-8 (byte {err.start})")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        return InvalidRecordError(index, BAD_JSON, f"{where} is not valid JSON ({err.msg})")


def _json_array(path, data: bytes) -> list:
    """The records of a file holding one JSON list: all or nothing (a one-line `UserError`), as the format gives
    no line to blame; its records are sized by their text later, as any source's (`validation.check_record_size`)."""
    try:
        records = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not valid UTF-8 at byte {err.start}") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(records, list):
        raise UserError(f"{path}: expected JSON Lines or a JSON list of records, got a {type(records).__name__}")
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
    if source.startswith(_LOCAL_HINTS) or Path(source).suffix.lower() in BUILDERS:
        raise DatasetNotFoundError(f"no such file or directory: {source}")
    return None  # not a local path: a Hub name


def _load_path(path: Path, split: str | None, max_record_bytes: int):
    import datasets

    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return _pick_split(datasets.load_from_disk(str(path)), split, str(path))
        return _load_folder(path, split, max_record_bytes)
    suffix = path.suffix.lower()
    if split not in (None, "train"):
        raise UserError(f"{path}: a single file has only the split 'train', not {split!r}")
    if suffix in (".json", ".jsonl"):
        return read_json_records(path, max_record_bytes=max_record_bytes)
    if suffix not in BUILDERS:
        raise UserError(f"{path}: unknown file type {suffix!r} ({EXPECTED})")
    return _read_with_builder(BUILDERS[suffix], {"train": [str(path)]})["train"]


def _load_folder(folder: Path, split: str | None, max_record_bytes: int):
    """The records of one split of a folder of data files (module docstring)."""
    files, reader = data_files(folder)
    split = split or "train"
    if split not in files:
        raise UserError(f"{folder}: no split {split!r} (available: {', '.join(files)})")
    if reader != "json":
        return _read_with_builder(reader, {split: files[split]})[split]
    records: list = []
    for f in files[split]:
        name = Path(f).relative_to(folder.resolve()).as_posix()
        records += read_json_records(f, first_index=len(records), where=f"{name} ",
                                     max_record_bytes=max_record_bytes)
    return records


def _read_with_builder(builder: str, files: dict[str, list[str]]):
    """`datasets.load_dataset(builder, data_files=files)`; a file the reader cannot read is a `UserError`
    naming it and the reader's reason (found by reading the files one at a time)."""
    import datasets

    read_errors = _read_errors()
    try:
        return datasets.load_dataset(builder, data_files=files)
    except read_errors as err:
        failed = err
    paths = [f for found in files.values() for f in found]
    for f in paths if len(paths) > 1 else ():  # which file: read them one at a time
        try:
            datasets.load_dataset(builder, data_files=f)
        except read_errors as err:
            failed, paths = err, [f]
            break
    raise UserError(f"{', '.join(paths)}: cannot be read as {builder} ({_reason(failed)})") from None


def _reason(err: BaseException) -> str:
    """The first line of what the reader said: the root cause (pandas, pyarrow) rather than datasets' wrapper."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _read_errors() -> tuple[type[BaseException], ...]:
    from datasets.exceptions import DatasetGenerationError
    from pyarrow import ArrowException

    return (DatasetGenerationError, ArrowException)


def load_records(
    source,
    split: str | None = "train",
    dataset_config: str | None = None,
    max_samples: int | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Sequence:
    """The records of one split of `source` (see module docstring), the first `max_samples` of them if set.

    max_record_bytes: the most bytes of one line of a JSON Lines file (0: no limit); a larger one is an
    `InvalidRecordError` in its place, for the error/skip policy (`record_lines`); records of every other source
    (a JSON list, files read by `datasets`) are measured later, by their text (`validation.check_record_size`).

    Returns a `datasets.Dataset` or a list; either way `len()` and `[i]` give record i as a dict.
    """
    if max_samples is not None and max_samples < 0:
        raise ConfigError(f"max_samples must be >= 0, got {max_samples}")
    refuse_streamed(source)
    if isinstance(source, dict) and _splits(source) is None and not _looks_like_record(source):  # {split: source}
        name = split or "train"
        if name not in source:
            raise UserError(f"no split {name!r} (available: {', '.join(source)})")
        return load_records(source[name], split=None, dataset_config=dataset_config, max_samples=max_samples,
                            max_record_bytes=max_record_bytes)
    if isinstance(source, (str, Path)):
        path = _local_path(str(source))
        if path is not None:
            records = _load_path(path, split, max_record_bytes)
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


def refuse_streamed(source) -> None:
    """A `UserError` (`STREAMING_REFUSED`) for a streamed dataset; nothing for any other source."""
    import sys

    datasets = sys.modules.get("datasets")  # a streamed dataset exists only where datasets is imported
    if datasets is not None and isinstance(source, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise UserError(f"a streamed dataset ({type(source).__name__}): {STREAMING_REFUSED}")


def _looks_like_record(obj: dict) -> bool:
    return any(k in obj for k in ("prompt", "chosen", "rejected", "completions"))
