"""The lines of a JSON Lines file, read in bounded memory whatever one line holds (`--max_record_bytes`).

A JSON record becomes Python objects several times its size, and its text is then tokenized: one 200 MB line
took a run past 6 GB before any message. So each line is read with `readline(limit + 2)`: a line longer than
the limit is never held whole; the rest of it is read through in `_CHUNK`-byte pieces only to count its bytes,
and the line is handed on as its size alone, for the reader to refuse or skip (`--invalid`) by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from prefixdpo.errors import ConfigError

DEFAULT_MAX_RECORD_BYTES = 16 * 2**20  # 16 MiB: far above any text record a causal LM trains on

MAX_RECORD_BYTES_HELP = (
    "The most bytes one record may hold. A JSON Lines record is measured as its line (without the line ending): "
    "a larger one is refused naming its file, line and size, or skipped and counted with --invalid skip, before "
    "it is parsed, so reading a JSON Lines file takes bounded memory whatever one line holds. A record of any "
    "other source (a JSON list, read whole; CSV, Parquet, Arrow, a Hub dataset) is measured by its text before it "
    "is tokenized. 0: no limit.")

# what the message of a record over the limit advises (`too_big_problem`, `validation.check_record_size`)
TOO_BIG_ADVICE = "(raise it, or 0 for no limit; --invalid skip leaves the record out, counted)"

_CHUNK = 1 << 20  # the rest of an over-long line is read through in pieces of this size


def check_max_record_bytes(value: int) -> None:
    """A `ConfigError` unless `value` is a byte count >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"max_record_bytes={value!r}: expected a number of bytes >= 0 (0: no limit)")


class OversizedLine(int):
    """The byte size of a line over the limit (an `int`), yielded in place of its bytes."""


def bounded_lines(fh: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | OversizedLine]]:
    """(line number from 1, the line's bytes without its line ending) for each line of `fh` (binary), or
    (line number, `OversizedLine(size)`) for a line of more than `limit` bytes (0: no limit). Memory stays within
    about `limit` + `_CHUNK` bytes whatever a line holds."""
    line_no = 0
    while True:
        piece = fh.readline(limit + 2) if limit else fh.readline()  # + 2: room for "\r\n"
        if not piece:
            return
        line_no += 1
        if not limit or piece.endswith(b"\n") or len(piece) < limit + 2:  # the whole line (the last may lack "\n")
            line = piece.rstrip(b"\r\n")
            yield line_no, OversizedLine(len(line)) if limit and len(line) > limit else line
            continue
        size = len(piece)
        while not piece.endswith(b"\n"):  # read through the rest of the line without holding it
            piece = fh.readline(_CHUNK)
            if not piece:
                break
            size += len(piece)
        yield line_no, OversizedLine(size - (2 if piece.endswith(b"\r\n") else 1 if piece.endswith(b"\n") else 0))


def first_byte(fh: BinaryIO) -> bytes:
    """The first byte of `fh` that is not white space (b"" for none), reading in bounded pieces; `fh` is left at
    its start."""
    while True:
        piece = fh.read(_CHUNK)
        if not piece:
            fh.seek(0)
            return b""
        head = piece.lstrip()[:1]
        if head:
            fh.seek(0)
            return head


def too_big_problem(where: str, line_no: int, size: int, limit: int) -> str:
    """The message of a record over the limit, after `record N: ` (`where`: its file, then a space)."""
    return f"{where}line {line_no} holds {size} bytes, more than --max_record_bytes {limit} {TOO_BIG_ADVICE}"
