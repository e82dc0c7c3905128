"""Files written whole or not at all: a reader (or a run resumed after a kill) never sees half a file.

Every file prefixdpo writes goes through here: it is written under a temporary name in the same folder,
flushed to disk, then renamed over the target (`os.replace` is atomic on POSIX within one filesystem).
A kill at any instant leaves either the old file or the new one, plus at most a `*.tmp-*` leftover that
nothing reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator

TMP_MARK = ".tmp-"  # leftovers of a killed write carry this in their name; readers ignore such names


def _temporary_name(path: str) -> str:
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f"{tail}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_path(path: str) -> None:
    """Flush a file, or a folder's entries, to disk (best effort where the OS refuses folders)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path in `path`'s folder; on success it is synced and renamed to `path`.

    For writers that want a file name (`savefig`, `save_file`); on an exception the temporary file is removed
    and `path` is untouched.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = _temporary_name(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)


def atomic_write_json(path: str, value, **dump_kwargs) -> None:
    """Write `value` as JSON to `path` atomically."""
    atomic_write_text(path, json.dumps(value, **dump_kwargs))


def replace_folder(tmp_dir: str, final_dir: str) -> None:
    """Make the complete folder `tmp_dir` appear as `final_dir` in one rename (an old `final_dir` is moved
    aside first and deleted after, so a kill leaves either folder whole, never a mix)."""
    for root, _, files in os.walk(tmp_dir):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)
    old = None
    if os.path.lexists(final_dir):
        old = _temporary_name(final_dir)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_path(os.path.dirname(os.path.abspath(final_dir)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def move_files_into(src_dir: str, dst_dir: str, *, last: str | None = None) -> None:
    """Move every file of `src_dir` (a complete, staged folder) into `dst_dir`, each by one rename (so each
    file is whole at every instant), `last` after all others; then remove `src_dir`."""
    names = []
    for root, _, files in os.walk(src_dir):
        names += [os.path.relpath(os.path.join(root, f), src_dir) for f in files]
    names.sort(key=lambda n: n == last)
    for name in names:
        fsync_path(os.path.join(src_dir, name))
        target = os.path.join(dst_dir, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(os.path.join(src_dir, name), target)
    fsync_path(dst_dir)
    shutil.rmtree(src_dir, ignore_errors=True)
