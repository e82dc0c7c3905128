"""Which files of a dataset folder are read, into which split, by which reader: every data file, or a refusal.

`datasets.load_dataset(folder)` reads a folder with one reader (the most common extension's) and splits it by
file name (`train*`, `test*`, `validation*`, `data/train-00000-of-00001.parquet`, ...; everything in `train`
when no name says a split). Two rules of its leave files out without a word: files of another type than the
reader's, and, once one file's name says a split, every file whose name says none (`train.jsonl` + `more.csv`:
only `train.jsonl` is read); it also never reads a few names (`config.json`, `dummy_data.zip`). So `data_files`
lists the files each split reads, and refuses in one line any folder holding a file that no split would read,
naming it and why, unless the file is clearly not data:

- hidden files and folders (`.gitattributes`, `.git/`, `.cache/`) and `__special__` folders, which `datasets`
  never reads either;
- `README*`, `LICENSE*` / `LICENCE*`, `CITATION*` (any extension: `README.txt` is no data) and the metadata
  `datasets` writes (`dataset_info.json`, `dataset_infos.json`).
"""

from __future__ import annotations

import os
from pathlib import Path

from prefixdpo.errors import UserError

# The reader of each file type prefixdpo reads (a `datasets` builder; "json" files are read by `loading` itself).
BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
EXPECTED = "expected .jsonl, .json, .parquet, .csv or .arrow"

_NOT_DATA_STEMS = ("readme", "license", "licence", "citation")
_NOT_DATA_NAMES = ("dataset_info.json", "dataset_infos.json")


def is_not_data(relative: Path) -> bool:
    """Whether a file of a dataset folder (its path inside the folder) is clearly no data (module docstring)."""
    if any(part.startswith((".", "__")) for part in relative.parts):
        return True
    name = relative.name.lower()
    return name.startswith(_NOT_DATA_STEMS) or name in _NOT_DATA_NAMES


def reader_of(path: str | Path) -> str:
    """The reader of a file ("json", "csv", "parquet", "arrow"), else its extension ("" for none)."""
    suffix = Path(path).suffix.lower()
    return BUILDERS.get(suffix, suffix)


def data_files(folder: Path) -> tuple[dict[str, list[str]], str]:
    """({split: files, in the order `datasets` reads them}, their reader) of a folder of data files: every file of
    the folder that is data is in a split, or a one-line `UserError` names the files that would be ignored."""
    root = folder.expanduser().resolve()
    found = _files(root)
    reader = _one_reader(folder, [p.relative_to(root).as_posix() for p in found])
    splits = {name: [f for f in files if not is_not_data(Path(f).relative_to(root))]
              for name, files in _datasets_splits(root).items()}
    splits = {name: files for name, files in splits.items() if files}
    read = {f for files in splits.values() for f in files}
    left_out = [p.relative_to(root).as_posix() for p in found if str(p) not in read]
    ignored_by_name = [name for name in left_out if Path(name).name in _datasets_ignores()]
    if ignored_by_name:
        raise UserError(f"{folder}: {_some(ignored_by_name)} would not be read: datasets never reads a file of that "
                        "name in a dataset folder, so rename it or move it out of the folder")
    if left_out:
        said = "; ".join(f"{name}: {_some([Path(f).relative_to(root).as_posix() for f in files])}"
                         for name, files in splits.items())
        raise UserError(f"{folder}: {_some(left_out)} would be read in no split: datasets splits a folder by file "
                        f"name (train*, validation*, test*; here {said}), and a file whose name says no split is left "
                        "out once another's does: rename it (e.g. train-NAME) or move it out of the folder")
    return splits, reader


def _files(root: Path) -> list[Path]:
    """Every file under `root` that may be data, sorted; hidden and `__special__` folders are not walked."""
    found = []
    for here, folders, files in os.walk(root, followlinks=True):
        folders[:] = [f for f in folders if not f.startswith((".", "__"))]
        found += [path for path in (Path(here, f) for f in files)
                  if path.is_file() and not is_not_data(path.relative_to(root))]
    return sorted(found)


def _datasets_ignores() -> set[str]:
    """File names `datasets.load_dataset(folder)` never reads as data (config.json, dataset_info.json, ...)."""
    from datasets.data_files import FILES_TO_IGNORE

    return set(FILES_TO_IGNORE)


def _datasets_splits(root: Path) -> dict[str, list[str]]:
    """{split: absolute file paths} as `datasets.load_dataset(root)` splits the folder (its own pattern rules)."""
    from datasets.data_files import DataFilesDict, get_data_patterns
    from datasets.load import _ALL_ALLOWED_EXTENSIONS  # the extensions load_dataset(folder) looks at

    base = root.as_posix()
    try:
        files = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base,
                                            allowed_extensions=_ALL_ALLOWED_EXTENSIONS)
    except FileNotFoundError:  # datasets' EmptyDatasetError: no data file at all
        return {}
    return {str(name): [str(Path(f)) for f in files] for name, files in files.items() if files}


def _one_reader(folder: Path, names: list[str]) -> str:
    """The one reader of the folder's files (paths inside it); a `UserError` naming every type and its files
    when they need several, or one prefixdpo does not read (.txt, .tsv, images, ...)."""
    by_reader: dict[str, list[str]] = {}
    for name in names:
        by_reader.setdefault(reader_of(name) or "no extension", []).append(name)
    if not by_reader:
        raise UserError(f"{folder}: no data files in this folder ({EXPECTED})")
    listing = "; ".join(f"{kind}: {_some(files)}" for kind, files in sorted(by_reader.items()))
    if len(by_reader) > 1:
        raise UserError(f"{folder}: holds data files of {len(by_reader)} types ({listing}); a dataset folder is "
                        "read with one reader, so keep one type in it or give one file as the dataset")
    (reader,) = by_reader
    if reader not in BUILDERS.values():
        raise UserError(f"{folder}: its data files ({listing}) are not a type prefixdpo reads ({EXPECTED})")
    return reader


def _some(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(sorted(names)[:shown]) + more
