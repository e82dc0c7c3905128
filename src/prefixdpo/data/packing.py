"""Bin packing of prefix-shared rows into fixed-length packed rows, and sharding packs over ranks.

Everything here works on integer row lengths (tokens of one prefix-shared row: prompt once + all
responses) and returns row *indices*; turning indices into tensors is the collator's job. So these are
pure functions with no torch dependency, cheap to test and to run over 100k rows.

Pipeline for one epoch:

    L    = auto_pack_length(lengths)                     # or a user-given length, a multiple of 128
    packs = plan_packs(lengths, L, seed=s, epoch=e)      # list of index groups, each sums to <= L
    plan  = deal_to_ranks(packs, world_size, B)          # [rank][micro-batch][packed row], B rows [B, L]
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

from prefixdpo.errors import ConfigError, UserError

__all__ = [
    "RowTooLongError",
    "auto_pack_length",
    "plan_packs",
    "packing_efficiency",
    "deal_to_ranks",
]


class RowTooLongError(UserError):
    """A single row is longer than the pack length; apply a drop/truncate policy before packing."""


def _check_lengths(row_lengths: Sequence[int]) -> list[int]:
    lengths = [int(n) for n in row_lengths]
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"row {i}: length must be positive, got {n}")
    return lengths


def round_up(n: float, multiple: int) -> int:
    """The least multiple of `multiple` that is >= n (line lengths: FlexAttention's 128-blocks, shard counts)."""
    return int(math.ceil(n / multiple)) * multiple


def auto_pack_length(
    row_lengths: Sequence[int], *, quantile: float = 0.95, factor: float = 1.1, multiple: int = 128
) -> int:
    """Default pack length: `factor` x the `quantile` of row lengths, rounded UP to `multiple`.

    This is the paper's rule (1.1 x the 95th percentile of prefix-shared row lengths) per packed row;
    the paper multiplies by the per-device batch size because it packs a whole batch into one row,
    we instead keep B packed rows of this length per micro-batch. Rounding to a multiple of 128 keeps
    FlexAttention's 128-blocks whole and means few distinct shapes (no recompiles).

    Choice: the result is never below the longest row rounded up to `multiple`. Otherwise the rows
    above the quantile (about 5%) could not be placed at all, and an *automatic* setting must never
    silently force the caller to drop data. A single very long outlier therefore raises the pack
    length for everyone; a caller who prefers dropping or truncating outliers passes an explicit length.

    Raises ValueError on an empty input or a non-positive length (naming the row index).
    """
    lengths = _check_lengths(row_lengths)
    if not lengths:
        raise ValueError("auto_pack_length: no rows")
    if not 0.0 < quantile <= 1.0 or factor <= 0 or multiple <= 0:
        raise ValueError(f"auto_pack_length: bad quantile={quantile} / factor={factor} / multiple={multiple}")
    q = float(np.quantile(np.asarray(lengths, dtype=np.float64), quantile))
    return max(round_up(factor * q, multiple), round_up(max(lengths), multiple))


def plan_packs(
    row_lengths: Sequence[int], pack_length: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True
) -> list[list[int]]:
    """Group row indices into packs whose total length is <= `pack_length` (best-fit decreasing).

    row_lengths: [N] positive ints (tokens of each prefix-shared row).
    returns:     packs, each a list of row indices; every index in 0..N-1 appears exactly once.

    Algorithm: rows are placed longest first, each into the open pack with the *least* remaining room
    that still fits it (best fit), else into a new pack. Open packs are kept in buckets keyed by their
    remaining room, with the distinct room values in a sorted list, so a placement is one bisect: about
    O(N log L) overall (100k rows take well under a second).

    Determinism and shuffling: the result depends only on (lengths, pack_length, seed, epoch, shuffle).
    With `shuffle`, rows of equal length are visited in a seeded per-epoch random order (so pack
    *contents* vary between epochs at no cost in efficiency) and the *order* of the packs is a seeded
    per-epoch permutation (so training does not see the longest packs first). Without it, ties are broken
    by index and packs come out in creation order (fullest-first-created, longest rows first).

    Raises RowTooLongError if a row is longer than `pack_length` (drop/truncate before packing), and
    ValueError for a non-positive length or pack length.
    """
    lengths = _check_lengths(row_lengths)
    pack_length = int(pack_length)
    if pack_length <= 0:
        raise ConfigError(f"pack_length must be positive, got {pack_length}")
    for i, n in enumerate(lengths):
        if n > pack_length:
            raise RowTooLongError(f"row {i}: length {n} exceeds pack_length {pack_length}")

    rng = np.random.default_rng([int(seed), int(epoch)]) if shuffle else None  # reproducible, independent epochs
    packs = _best_fit(lengths, _longest_first(lengths, rng), pack_length)
    if rng is not None:
        perm = rng.permutation(len(packs)).tolist()
        packs = [packs[p] for p in perm]
    return packs


def _longest_first(lengths: list[int], rng: np.random.Generator | None) -> list[int]:
    """Row indices, longest first; rows of equal length in `rng`'s random order, or by index without it."""
    tie_break = rng.permutation(len(lengths)) if rng is not None else np.arange(len(lengths))
    # lexsort sorts by the last key first: longest rows first, ties by the tie-break rank.
    return np.lexsort((tie_break, -np.asarray(lengths, dtype=np.int64))).tolist()


def _best_fit(lengths: list[int], order: list[int], pack_length: int) -> list[list[int]]:
    """Rows placed in `order`, each into the open pack with the least room that still fits it, else a new pack
    (see `plan_packs`). Every length is <= pack_length."""
    packs: list[list[int]] = []
    rooms: list[int] = []  # distinct remaining-room values that have at least one open pack, sorted
    by_room: dict[int, list[int]] = {}  # remaining room -> pack ids with exactly that room (a stack)
    for idx in order:
        need = lengths[idx]
        pos = bisect.bisect_left(rooms, need)
        if pos < len(rooms):
            room = rooms[pos]
            bucket = by_room[room]
            pack_id = bucket.pop()
            if not bucket:
                del by_room[room]
                del rooms[pos]
            packs[pack_id].append(idx)
            left = room - need
        else:
            pack_id = len(packs)
            packs.append([idx])
            left = pack_length - need
        if left > 0:  # a full pack can take nothing more: keep it out of the search
            if left not in by_room:
                by_room[left] = []
                bisect.insort(rooms, left)
            by_room[left].append(pack_id)
    return packs


def packing_efficiency(row_lengths: Sequence[int], packs: Sequence[Sequence[int]], pack_length: int) -> float:
    """Real tokens / (number of packs x pack_length); padding and empty packs count as waste.

    Returns 0.0 when there are no packs (nothing computed, nothing useful).
    """
    if not packs:
        return 0.0
    real = sum(int(row_lengths[i]) for pack in packs for i in pack)
    return real / (len(packs) * int(pack_length))


def deal_to_ranks(lines: Sequence[Sequence[int]], world_size: int, batch_size: int) -> list[list[list[list[int]]]]:
    """Deal lines (packs, or one example each) to ranks: ``[rank][micro-batch][line]``.

    Micro-batch k of every rank together holds the k-th slab of ``world_size x batch_size`` consecutive
    lines, dealt strided within the slab (rank r: ``slab[r::world_size]``), so one process with
    ``world_size x`` the batch size, or with ``world_size`` accumulation steps, trains the same lines in
    the same optimizer steps: which lines form a step never depends on the world size. Every rank runs
    the same number of micro-batches (a rank that stopped early would hang the next collective); in the
    last, partial slab a rank may get fewer lines, or none (the trainer runs an empty micro-batch with
    zero weight). Nothing is split, dropped or duplicated.
    """
    world_size, batch_size = int(world_size), int(batch_size)
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if batch_size <= 0:
        raise ConfigError(f"the per-device batch size must be positive, got {batch_size}")
    slab = world_size * batch_size
    plan: list[list[list[list[int]]]] = [[] for _ in range(world_size)]
    for start in range(0, len(lines), slab):
        chunk = lines[start:start + slab]
        for rank in range(world_size):
            plan[rank].append([list(line) for line in chunk[rank::world_size]])
    return plan
