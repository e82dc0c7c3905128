"""Sequence parallelism (Ulysses) for prefix-shared lines: one line's tokens over N ranks.

Everything outside attention runs on each rank's own 1/N of the line's columns (embeddings, MLPs, norms, the LM
head at the response positions it holds). Around every attention call DeepSpeed's Ulysses all-to-all
(`deepspeed.sequence.layer.DistributedAttention`) turns the ranks' local queries, keys and values
``[B, l, H, D]`` (l = L / N) into head shards of the whole line ``[B, L, H / N, D]``, the attention runs there with
the whole line's plan (any backend: dense SDPA, flex's BlockMask, segmented, varlen), and the output goes back the
same way. So the attention rule, ours included, applies unchanged: each head sees every token.

Why this engine and not another: DeepSpeed's higher-level `UlyssesSPAttentionHF` (ALST, and accelerate's
`ParallelismConfig(sp_backend="deepspeed")` built on it) drops every 4D mask and replaces a BlockMask with plain
causal attention, and transformers' and accelerate's context parallelism refuse non-causal masks; the layer below
them, `DistributedAttention`, takes any local attention and passes our mask through untouched. No all-to-all of
our own.

The per-token log-probs (and scores) are computed where their predicting position lives and put into one
``[T]`` tensor on every rank by a sum over the group (`sum_over_group`), whose backward sums the ranks' gradients:
every collective's backward is its adjoint, so each rank's gradient is N x its share of the one-process gradient,
and the engine's average over all W = N x M ranks turns it into the one-process gradient of its data-parallel
group's loss (the loss's share is M / pairs instead of W / pairs: `training.base._step_share`).

The model carries its group (`attach`); the pass puts it in its plan (`PassPlan.for_shard`), where the attention
finds it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixdpo.errors import ConfigError

_ATTRIBUTE = "_prefixdpo_sequence_parallel"
_GROUPS: dict[tuple[int, int], Any] = {}  # (size, world) -> this rank's group: new_group is collective, build once


@dataclass(frozen=True, eq=False)
class SequenceParallel:
    """This rank's sequence-parallel group: `size` ranks holding one line between them, this one `rank` of them
    (its columns [rank x l, (rank + 1) x l) of a line of L = size x l)."""

    size: int
    rank: int
    group: Any
    attention: Any = field(repr=False)  # DistributedAttention over `group`

    def __deepcopy__(self, memo):  # a model copied with its group shares it (a process group cannot be copied)
        return self

    def attend(self, attend, module, query, key, value, plan, **kwargs):
        """`attention` over this group (what `backends.prefix_attention_forward` calls with the pass's plan)."""
        return attention(self, attend, module, query, key, value, plan, **kwargs)

    def local_length(self, length: int) -> int:
        """Columns this rank holds of a line of `length` (which the loader made a multiple of `size`)."""
        if length % self.size:
            raise ValueError(f"a line of {length} columns does not split over sequence_parallel_size={self.size}: "
                             "its lines must be padded to a multiple of it (`pad_multiple_for`)")
        return length // self.size

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> this rank's [B, l, ...]."""
        n = self.local_length(t.shape[1])
        return t[:, self.rank * n:(self.rank + 1) * n]

    def owned(self, columns: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(bool [T]: which of the line `columns` [T] this rank holds, their local columns [t])."""
        n = self.local_length(length)
        mine = (columns // n) == self.rank
        return mine, columns[mine] - self.rank * n

    def most_owned(self, columns: torch.Tensor, length: int) -> int:
        """The most of `columns` [T] any rank of the group holds (every rank computes it alike, from the line)."""
        n = self.local_length(length)
        return int(torch.bincount(columns // n, minlength=self.size).max()) if columns.numel() else 0

    def gathered(self, values: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """The whole [T, ...] on every rank from each rank's `values` [t, ...] at its `mine` [T] (a differentiable
        sum over the group: exact, each entry is one rank's and zeros)."""
        whole = values.new_zeros((mine.shape[0], *values.shape[1:]))
        return sum_over_group(whole.index_put((mine.nonzero().squeeze(1),), values), self.group)


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(sum) whose backward is all_reduce(sum) of the gradients: the adjoint when every rank's loss counts
    (module docstring)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = t.contiguous().clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_group(t: torch.Tensor, group) -> torch.Tensor:
    return _SumOverGroup.apply(t, group)


def attach(model, sp: SequenceParallel | None) -> None:
    """Make `model`'s prefixdpo passes sequence parallel over `sp` (None: not)."""
    from prefixdpo.core.model_checks import unwrap

    setattr(unwrap(model), _ATTRIBUTE, sp)


def of(model) -> SequenceParallel | None:
    """The group `model`'s passes run over, or None."""
    from prefixdpo.core.model_checks import unwrap

    return getattr(unwrap(model), _ATTRIBUTE, None)


def data_parallel(size: int) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel world size): consecutive ranks form a sequence group."""
    from prefixdpo.core.rank_decisions import rank_and_world

    rank, world = rank_and_world()
    return rank // size, max(world // size, 1)


def pad_multiple_for(pad_multiple: int | None, size: int) -> int:
    """The multiple lines are padded to: `pad_multiple` (None: 1) made a multiple of `size` too."""
    import math

    base = pad_multiple or 1
    return base * size // math.gcd(base, size)


def check_size(size: int) -> None:
    """One-line ConfigError unless `size` splits the launched processes into groups."""
    if size < 1:
        raise ConfigError(f"sequence_parallel_size={size}: must be >= 1")
    if size == 1:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % size:
        raise ConfigError(f"sequence_parallel_size={size} does not divide the {world} launched process(es): launch "
                          f"a multiple of it (torchrun --nproc_per_node {size})")


def check_model(model, size: int) -> None:
    """One-line ConfigError where heads cannot be split evenly over `size` ranks (each rank must hold whole query
    heads and the key/value heads they read)."""
    from prefixdpo.core.model_checks import base_model, text_config

    cfg = text_config(base_model(model))
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads is None:
        raise ConfigError(f"sequence_parallel_size={size}: {type(cfg).__name__} names no num_attention_heads")
    for name, count in (("attention heads", heads), ("key/value heads", kv)):
        if count % size:
            raise ConfigError(f"sequence_parallel_size={size} does not divide the model's {count} {name}: choose a "
                              "size that divides both its attention heads and its key/value heads")


def new_sequence_parallel(size: int) -> SequenceParallel | None:
    """This rank's group of `size` consecutive ranks (None for size 1), on DeepSpeed's Ulysses all-to-all. Every
    rank must call it (building the groups is collective)."""
    check_size(size)
    if size == 1:
        return None
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ConfigError(f"sequence_parallel_size={size} needs {size} processes: launch with torchrun "
                          f"--nproc_per_node {size} (or accelerate launch)")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed looks for a GPU and aborts
    try:
        import deepspeed
        import deepspeed.comm
        from deepspeed.sequence.layer import DistributedAttention
    except ImportError:
        raise ConfigError("sequence_parallel_size > 1 runs on DeepSpeed's Ulysses all-to-all: pip install "
                          "deepspeed") from None
    if not deepspeed.comm.is_initialized():
        if not torch.cuda.is_available():
            # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce kernel first (measured: 2 minutes when its
            # build is not cached); only its all-to-all runs here, through torch.distributed
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    key = (size, world)
    if key not in _GROUPS:
        for start in range(0, world, size):  # every rank builds every group, in the same order
            group = torch.distributed.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                _GROUPS[key] = group
    group = _GROUPS[key]
    attention = DistributedAttention(_head_shard_attention, group, scatter_idx=2, gather_idx=1)
    return SequenceParallel(size=size, rank=rank % size, group=group, attention=attention)


def _head_shard_attention(query, key, value, attend, module, plan, kwargs):
    """The local attention DistributedAttention runs on head shards of the whole line: query [B, L, H/N, D], key and
    value [B, L, Hkv/N, D] -> [B, L, H/N, D] (transformers' attention functions take [B, heads, L, D] and return
    [B, L, heads, D])."""
    out, _ = attend(module, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), plan, **kwargs)
    return out


def attention(sp: SequenceParallel, attend, module, query, key, value, plan, **kwargs):
    """`attend` (`backends._line_attention`) of this rank's columns, over the whole line: query [B, H, l, D],
    key/value [B, Hkv, l, D], plan the whole line's pass plan -> ([B, l, H, D], None)."""
    for feature in ("s_aux", "sinks"):
        if kwargs.get(feature) is not None:
            raise ConfigError(f"sequence parallelism does not split attention '{feature}' over heads yet: set "
                              "sequence_parallel_size 1 for this model")
    out = sp.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0, None,
                       attend, module, plan, kwargs)
    return out, None


__all__ = ["SequenceParallel", "attach", "attention", "check_model", "check_size", "data_parallel",
           "new_sequence_parallel", "of", "pad_multiple_for", "sum_over_group"]
