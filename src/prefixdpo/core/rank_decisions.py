"""Decisions taken once for all ranks of a run.

Anything a rank decides from its own disk (does a cache file exist and hold what it claims, is a folder
built) can come out differently on another rank: per-node `~/.cache`, a node-local output folder, a file
another run is replacing. Ranks that decide differently then run different collectives, which is a hang on
NCCL or a crash on gloo. So such a decision is taken by one rank and sent to the others, or taken from the
same gathered facts by every rank.

Every function here is the identity of a single process when no process group is initialised.
"""

from __future__ import annotations

from typing import Any

import torch


def _group_is_up() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(global rank, world size) of this process; (0, 1) without a process group."""
    if _group_is_up():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (any picklable object: CPU tensors travel inside it)."""
    _, world = rank_and_world()
    if world == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool, device="cpu") -> bool:
    """True on every rank if `flag` is true on any rank (one all-reduce; every rank must call it together)."""
    _, world = rank_and_world()
    if world == 1:
        return flag
    t = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def max_over_ranks(values: list[int], device="cpu") -> list[int]:
    """The element-wise maximum of every rank's `values` (one all-reduce of len(values) ints; every rank must call
    it together, with as many values)."""
    _, world = rank_and_world()
    if world == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.long, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def gather(value: Any) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    _, world = rank_and_world()
    if world == 1:
        return [value]
    out: list = [None] * world
    torch.distributed.all_gather_object(out, value)
    return out


def wait_for_all() -> None:
    """Return when every rank has come here (what one rank wrote before it is then there for all)."""
    _, world = rank_and_world()
    if world > 1:
        torch.distributed.barrier()
