"""Saves that fail for space or I/O, said as such; and a warning at start when a checkpoint will not fit.

A full disk reaches prefixdpo in several disguises: an `OSError` with errno ENOSPC from Python's own writes,
safetensors' `SafetensorError` quoting "No space left on device", and torch's opaque
`RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos ...` (or `... file write failed`) from
`torch.save`, which names no cause at all. `save_failure_cause` turns each into the phrase a user needs ("no
space left on device"); for torch's opaque form it looks at the folder's free space (`shutil.disk_usage`) to tell
a full disk from another write failure.
"""

from __future__ import annotations

import errno
import os
import shutil

# errno -> the cause as a user reads it (what `strerror` says, in lower case)
CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EIO: "input/output error",
    errno.EROFS: "read-only file system",
    errno.EFBIG: "file too large",
}
# how libraries that do not raise OSError quote the same errors (safetensors quotes Rust's io::Error)
QUOTED = (("no space left on device", errno.ENOSPC), ("storagefull", errno.ENOSPC), ("os error 28", errno.ENOSPC),
          ("disk quota exceeded", errno.EDQUOT), ("input/output error", errno.EIO),
          ("read-only file system", errno.EROFS))
# torch.save's own writer reports a failed write without its errno
TORCH_WRITE_FAILURES = ("unexpected pos", "file write failed")
NEARLY_FULL = 64 << 20  # free bytes below which a failed torch write is taken for a full disk


def free_bytes(folder: str) -> int | None:
    """Free bytes (for an unprivileged user) on the filesystem of `folder` or its nearest existing parent."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _chain(err: BaseException):
    """`err` and the exceptions it was raised from or during (each once)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def save_failure_cause(err: BaseException, folder: str) -> str | None:
    """The cause of a failed save into `folder` as one phrase ("no space left on device", ...), or None when
    `err` is not a space or I/O failure (a bug, which keeps its traceback)."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in CAUSES:
            return CAUSES[e.errno]
        text = str(e).lower()
        for quoted, code in QUOTED:
            if quoted in text:
                return CAUSES[code]
        if isinstance(e, RuntimeError) and "inline_container" in text and any(m in text for m in TORCH_WRITE_FAILURES):
            free = free_bytes(folder)
            if free is not None and free < NEARLY_FULL:
                return CAUSES[errno.ENOSPC]
            first = " ".join(str(e).split())[:160]
            return f"a write failed (torch: {first}; {human_bytes(free) if free is not None else 'unknown'} free)"
    return None


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def checkpoint_size_estimate(model, save_only_model: bool = False) -> tuple[int, int]:
    """(weights, optimizer state) in bytes of one checkpoint of `model`, as Trainer saves it.

    Weights: every parameter as stored (its dtype), or only the trainable ones for a PEFT model (a checkpoint
    holds its adapters). Optimizer state: AdamW's two moments per trainable parameter, in that parameter's dtype
    (torch's AdamW keeps them so); none with `save_only_model`. The rest of a checkpoint (scheduler, RNG and
    trainer state, tokenizer) is small beside them and is left to the caller's slack."""
    from prefixdpo.core.model_checks import unwrap

    inner = unwrap(model)
    adapters_only = hasattr(inner, "peft_config")
    weights = optimizer = 0
    for p in inner.parameters():
        size = int(getattr(p, "ds_numel", p.numel())) * p.element_size()  # ZeRO-3 keeps the real numel aside
        if p.requires_grad or not adapters_only:
            weights += size
        if p.requires_grad and not save_only_model:
            optimizer += 2 * size
    return weights, optimizer


def short_space_warning(output_dir: str, model, save_only_model: bool = False) -> str | None:
    """One line when `output_dir`'s filesystem has less free space than one checkpoint of `model` needs (the
    estimate plus 2% and 1 MiB for the small files), else None."""
    weights, optimizer = checkpoint_size_estimate(model, save_only_model)
    needed = int((weights + optimizer) * 1.02) + (1 << 20)
    free = free_bytes(output_dir)
    if free is None or free >= needed:
        return None
    parts = f"weights {human_bytes(weights)}" + (f" + optimizer state {human_bytes(optimizer)}" if optimizer else "")
    return (f"warning: {output_dir} has {human_bytes(free)} free, less than one checkpoint needs (about "
            f"{human_bytes(needed)}: {parts}); saving a checkpoint will fail unless space is freed")
