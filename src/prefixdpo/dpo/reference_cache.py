"""Tables of reference log-prob sums, computed once per dataset and cached on disk.

A table belongs to the *content* of a list of examples (`data_fingerprint`), never to a Python object. How a
batch's sums are computed is the caller's (`sums_of`, a reference strategy's no-grad pass: `reference.py`);
here: the table's layout, its on-disk key, and how ranks share the work and the file.

The on-disk key covers the model config, every byte of every weight (gathered when sharded), the
examples' content and the settings. A cache file is used only if it proves its content: its cache version,
its stored key, the sha256 of its payload, offsets that step by each example's response count, and finite
values; anything else is recomputed with one warning line and the file rewritten (atomically). Rank 0
alone reads and writes the cache, and its table reaches every rank: see `load_or_compute_table`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Sequence

import torch

from prefixdpo.atomic_io import atomic_path
from prefixdpo.core.fingerprints import config_fingerprint, data_fingerprint, weights_fingerprint
from prefixdpo.core.model_checks import unwrap
from prefixdpo.data.batch import Batch, build_batch
from prefixdpo.data.example import Example
from prefixdpo.core.rank_decisions import from_rank0, gather, rank_and_world

logger = logging.getLogger(__name__)

CACHE_VERSION = "prefixdpo-ref-logps-v3"  # v3: the payload's sha256 and the version in the file's metadata


@dataclass
class RefLogpsTable:
    """Reference log-prob sums of every response of a dataset.

    sums:    [total responses] fp32, responses in example order
    offsets: [N + 1] long; example i's responses are sums[offsets[i]:offsets[i+1]]
    """

    sums: torch.Tensor
    offsets: torch.Tensor

    def gather(self, example_ids: torch.Tensor) -> torch.Tensor:
        """Sums of the responses of `example_ids` [E], concatenated in that order (a Batch's order) -> [R]."""
        parts = [self.sums[self.offsets[e] : self.offsets[e + 1]] for e in example_ids.tolist()]
        return torch.cat(parts) if parts else self.sums.new_zeros(0)

    def __len__(self) -> int:
        return int(self.offsets.numel() - 1)


def cache_key(model, examples: Sequence[Example], settings: dict, *, skip_adapter: bool = False) -> str:
    parts = {
        "version": CACHE_VERSION,
        "config": config_fingerprint(model),
        "weights": weights_fingerprint(model, skip_adapter=skip_adapter),
        "data": data_fingerprint(examples),
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def compute_table(sums_of: Callable[[Batch], torch.Tensor], examples: Sequence[Example], *, batch_size: int = 8,
                  pad_token_id: int = 0, device="cpu", prefix_sharing: bool = True) -> RefLogpsTable:
    """The table of `examples`: `sums_of(batch)` -> no-grad sums [R] over prefix-shared batches (unshared rows with
    `prefix_sharing` False: a model on its own attention, `core.stock_attention`) of `batch_size` examples on
    `device`, the examples shared out over ranks, then gathered."""
    rank, world = rank_and_world()
    mine = list(range(rank, len(examples), world))
    mine.sort(key=lambda i: examples[i].shared_length)  # similar lengths together: less padding
    results: dict[int, list[float]] = {}
    # every rank runs the same number of batches: a sharded (FSDP2 / ZeRO-3) model's forward is a collective
    batches = -(-(-(-len(examples) // world)) // batch_size)
    for start in range(0, batches * batch_size, batch_size):
        ids = mine[start : start + batch_size]
        run = ids or [0]  # a rank out of examples runs example 0 and keeps nothing
        batch = build_batch([examples[i] for i in run], prefix_sharing=prefix_sharing,
                            pad_token_id=pad_token_id).to(device)
        sums = sums_of(batch).detach().float().cpu()
        offset = 0
        for i in ids:
            k = examples[i].num_responses
            results[i] = sums[offset : offset + k].tolist()
            offset += k
    results = {i: v for part in gather(results) for i, v in part.items()}
    flat = [v for i in range(len(examples)) for v in results[i]]
    offsets = [0]
    for ex in examples:
        offsets.append(offsets[-1] + ex.num_responses)
    return RefLogpsTable(torch.tensor(flat, dtype=torch.float32), torch.tensor(offsets, dtype=torch.long))


def payload_checksum(table: RefLogpsTable) -> str:
    """sha256 of the table's bytes: sums [total responses] fp32, then offsets [N + 1] int64."""
    h = hashlib.sha256()
    for t in (table.sums, table.offsets):
        h.update(t.detach().contiguous().cpu().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def table_problem(table: RefLogpsTable, examples: Sequence[Example]) -> str | None:
    """Why `table` cannot be the table of `examples`, or None: sums must be a finite fp32 vector and offsets
    [N + 1] must start at 0 and step by each example's response count up to the length of sums."""
    sums, offsets = table.sums, table.offsets
    if sums.dtype != torch.float32 or sums.dim() != 1 or offsets.dtype != torch.long or offsets.dim() != 1:
        return f"sums {sums.dtype} {tuple(sums.shape)} / offsets {offsets.dtype} {tuple(offsets.shape)} are not " \
               "a float32 vector and an int64 vector"
    if offsets.numel() != len(examples) + 1:
        return f"offsets for {offsets.numel() - 1} examples, the data has {len(examples)}"
    if offsets.numel() == 0 or int(offsets[0]) != 0:
        return "offsets do not start at 0"
    counts = torch.tensor([ex.num_responses for ex in examples], dtype=torch.long)
    wrong = (offsets.diff() != counts).nonzero().flatten()
    if wrong.numel():
        i = int(wrong[0])
        return f"offsets give example {i} {int(offsets[i + 1] - offsets[i])} responses, it has {int(counts[i])}"
    if int(offsets[-1]) != sums.numel():
        return f"offsets end at {int(offsets[-1])}, sums hold {sums.numel()} values"
    bad = int((~torch.isfinite(sums)).sum())
    if bad:
        return f"{bad} of its {sums.numel()} values are not finite"
    return None


def read_cached_table(path: str, key: str, examples: Sequence[Example]) -> tuple[RefLogpsTable | None, str]:
    """(table, "") if the file at `path` proves it holds `key`'s table of `examples`, else (None, why not).

    A missing file is (None, "missing"). Proof: this cache version, this key, a payload whose sha256 is the
    stored one, and a table that fits the examples (`table_problem`).
    """
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
            names = sorted(fh.keys())
            if names != ["offsets", "sums"]:
                return None, f"it holds tensors {names}, not offsets and sums"
            table = RefLogpsTable(fh.get_tensor("sums"), fh.get_tensor("offsets"))
    except FileNotFoundError:
        return None, "missing"
    except Exception as exc:  # truncated or garbage bytes: whatever the reader raises, the file holds no table
        reason = (str(exc).strip().splitlines() or [""])[0]
        return None, f"unreadable ({type(exc).__name__}: {reason})"
    if meta.get("version") != CACHE_VERSION:
        return None, f"written by cache version {meta.get('version', 'v2 or older')}, this is {CACHE_VERSION}"
    if meta.get("key") != key:
        return None, "its stored key is another model's, data's or settings'"
    if meta.get("sha256") != payload_checksum(table):
        return None, "its payload does not match its checksum (edited or damaged)"
    problem = table_problem(table, examples)
    if problem is not None:
        return None, problem
    return table, ""


def cached_table(path: str, key: str, examples: Sequence[Example]) -> RefLogpsTable | None:
    """The proven table at `path`, or None; a file that is there but proves nothing is one warning line."""
    table, why = read_cached_table(path, key, examples)
    if table is None and why != "missing":
        logger.warning("reference cache %s not used, recomputing it: %s", path, why)
    return table


def write_table(path: str, table: RefLogpsTable, key: str) -> None:
    """Save `table` with its key, the cache version and its payload checksum, atomically. A failed write is
    one warning: the cache only saves time, and one rank must not stop while the others train on."""
    from safetensors.torch import save_file

    metadata = {"key": key, "version": CACHE_VERSION, "sha256": payload_checksum(table)}
    try:
        with atomic_path(path) as tmp:
            save_file({"sums": table.sums.contiguous(), "offsets": table.offsets.contiguous()}, tmp,
                      metadata=metadata)
    except OSError as exc:
        logger.warning("could not save reference cache %s (%s): the next run computes it again", path, exc)


def load_or_compute_table(
    model, examples: Sequence[Example], cache_dir: str, *, sums_of: Callable[[Batch], torch.Tensor],
    skip_adapter: bool = False, settings: dict | None = None, batch_size: int = 8, pad_token_id: int = 0,
    device=None, prefix_sharing: bool = True,
) -> tuple[RefLogpsTable, str, bool]:
    """The reference table of `examples` from `cache_dir` if the file of this key proves it holds it
    (`read_cached_table`), else computed by `sums_of` (`compute_table`) and saved. Returns (table, path,
    loaded_from_cache).

    model: the weights the table comes from, for the key (`skip_adapter`: its LoRA weights left out, the
           reference being the base model with the adapter off); `device` defaults to its parameters'.
    prefix_sharing: the layout of the batches computed (`compute_table`); the same sums either way, so not in the key.

    Ranks take one decision: rank 0 alone reads the cache, and its hit or miss, with the table on a hit,
    is broadcast, so other ranks never read their own disk (a per-node `~/.cache` may be empty or hold
    something else). On a miss every rank computes (`compute_table` shares the work out) and rank 0 alone
    writes: the only reader is the only writer, so ranks sharing the folder (one node's, or every node's
    on a shared home) never write the same file at once, and a copy elsewhere would never be read.
    """
    key = cache_key(model, examples, dict(settings or {}), skip_adapter=skip_adapter)  # collective when sharded
    path = os.path.join(cache_dir, f"ref_logps_{key[:32]}.safetensors")
    rank, _ = rank_and_world()
    table = from_rank0(cached_table(path, key, examples) if rank == 0 else None)
    if table is not None:
        return table, path, True
    device = device or next(unwrap(model).parameters()).device
    table = compute_table(sums_of, examples, batch_size=batch_size, pad_token_id=pad_token_id, device=device,
                          prefix_sharing=prefix_sharing)
    if rank == 0:
        write_table(path, table, key)
    return table, path, False
