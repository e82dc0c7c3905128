"""Examples -> micro-batches, per epoch and per data-parallel rank.

One *plan* per epoch decides which examples go into which line of which micro-batch on which rank;
every rank computes the same global plan (it is a pure function of lengths, seed and epoch), so each
rank also knows, without any communication, how many preference pairs the whole optimizer step holds
across all ranks. The trainer divides by that count, so gradient accumulation and data parallelism
normalise by pairs exactly even when packing makes the pair count vary per micro-batch.

Plan shape: ``plan[rank][micro_batch] = [line, ...]``, ``line = [example index, ...]``. Unpacked, a
line is one example; packed, a line holds the examples of one pack. In the last, partial slab of lines
a rank's micro-batch may hold fewer lines, or none: a micro-batch with no example at all becomes a
zero-weight batch that still runs the model (so the engines' collectives line up).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from prefixdpo.data.batch import Batch, build_batch
from prefixdpo.data.lines import padded
from prefixdpo.data.example import Example
from prefixdpo.data.packing import (
    RowTooLongError, auto_pack_length, deal_to_ranks, plan_packs,
)
from prefixdpo.data.tree import TreePlan, build_tree_batch, plan_tree_lines
from prefixdpo.errors import UserError

Plan = list[list[list[list[int]]]]  # [rank][micro-batch][line][example index]


@dataclass(frozen=True)
class LoaderSettings:
    """How examples become micro-batches.

    batch_size:  examples per micro-batch (unpacked) or packed lines per micro-batch (packing).
    pack_length: line length when packing (None = `auto_pack_length` of the rows).
    grad_accum:  micro-batches per optimizer step (for the per-step pair totals).
    pad_multiple: unpacked lines are padded to a multiple of this.
    bucket:      unpacked lines are padded to one of a few lengths (`bucket_length`), so compiled
                 FlexAttention does not recompile for every batch.
    shuffle:     a seeded permutation of the examples per epoch (unpacked), or seeded best-fit packs in
                 a seeded order (packing). False: file order unpacked, but packs still best-fit with
                 the longest rows first (fewest lines; evaluation, where order does not matter).
    sequential:  file order, every epoch: `train_sampling_strategy="sequential"` (transformers'
                 SequentialSampler). Packed, consecutive examples fill a line until the next one does
                 not fit. Takes precedence over `shuffle`.
    prefix_tree: packed lines are token tries across their examples (`data.tree`): the examples are visited in
                 trie order (file order when `sequential`), subtrees placed whole into lines by their trie's tokens
                 (`plan_tree_lines`), and the lines shuffled with (seed, epoch) when `shuffle`. Needs packing and
                 prefix sharing.
    """

    batch_size: int = 1
    prefix_sharing: bool = True
    packing: bool = False
    pack_length: int | None = None
    pad_token_id: int = 0
    pad_multiple: int = 1
    bucket: bool = False
    shuffle: bool = True
    sequential: bool = False
    seed: int = 0
    grad_accum: int = 1
    prefix_tree: bool = False


def row_length(example: Example, prefix_sharing: bool) -> int:
    """Tokens one example occupies in a line: its prefix-shared row, or all K standard rows."""
    return example.shared_length if prefix_sharing else example.unshared_length


def resolve_pack_length(examples: Sequence[Example], settings: LoaderSettings) -> int | None:
    if not settings.packing:
        return None
    lengths = [row_length(ex, settings.prefix_sharing) for ex in examples]
    if settings.pack_length is not None:
        return int(settings.pack_length)
    return auto_pack_length(lengths)


def pack_in_order(row_lengths: Sequence[int], pack_length: int) -> list[list[int]]:
    """Consecutive row indices into lines of total length <= `pack_length`, in order (next fit).

    row_lengths: [N] positive ints. Returns lines whose concatenation is 0..N-1. A line closes when
    the next row does not fit; no order-keeping (contiguous) split has fewer lines. Raises
    RowTooLongError naming the first row longer than `pack_length`.
    """
    lines: list[list[int]] = []
    room = 0
    for i, n in enumerate(row_lengths):
        if n > pack_length:
            raise RowTooLongError(f"row {i}: length {n} exceeds pack_length {pack_length}")
        if not lines or n > room:
            lines.append([])
            room = pack_length
        lines[-1].append(i)
        room -= n
    return lines


def _check_rows_fit(examples: Sequence[Example], lengths: Sequence[int], pack_length: int) -> None:
    """RowTooLongError for the first example whose row is longer than `pack_length`, named by the user's
    record number (packing itself only knows row indices, which mean nothing to the user)."""
    for i, (ex, n) in enumerate(zip(examples, lengths)):
        if n > pack_length:
            where = f"record {ex.source_index}" if ex.source_index >= 0 else f"example {i}"
            raise RowTooLongError(
                f"{where}: its row holds {n} tokens, more than pack_length={pack_length} "
                "(raise pack_length, or lower max_length to truncate or drop long records)"
            )


def plan_epoch(
    examples: Sequence[Example], settings: LoaderSettings, epoch: int, world_size: int, pack_length: int | None = None,
    tree_plan: TreePlan | None = None,
) -> Plan:
    """The global plan of one epoch: for every rank, its micro-batches of lines of example indices.

    The lines of the epoch are planned globally (as one process would), then dealt to ranks in slabs
    (`deal_to_ranks`): micro-batch k on all ranks together covers the same lines as micro-batch k of one
    process with world_size x the batch size, so the optimizer steps hold the same pairs whatever the
    world size and accumulation (what makes a W-rank run equal a 1-process run). Every rank gets the
    same number of micro-batches. With `settings.prefix_tree`, the lines are `tree_plan`'s (planned here when None).
    """
    n = len(examples)
    if settings.packing:
        lengths = [row_length(ex, settings.prefix_sharing) for ex in examples]
        pack_length = pack_length or resolve_pack_length(examples, settings)
        _check_rows_fit(examples, lengths, pack_length)
        if settings.prefix_tree:
            lines = tree_lines(tree_plan or plan_trees(examples, settings, pack_length), settings, epoch)
        elif settings.sequential:
            lines = pack_in_order(lengths, pack_length)
        else:
            lines = plan_packs(lengths, pack_length, seed=settings.seed, epoch=epoch, shuffle=settings.shuffle)
    else:
        if settings.shuffle and not settings.sequential:
            order = np.random.default_rng([int(settings.seed), int(epoch)]).permutation(n).tolist()
        else:
            order = list(range(n))
        lines = [[i] for i in order]
    return deal_to_ranks(lines, world_size, settings.batch_size)


def tree_lines(tree_plan: TreePlan, settings: LoaderSettings, epoch: int) -> list[list[int]]:
    """The lines of tries of one epoch: `tree_plan`'s (the same every epoch), in a seeded order per epoch when
    shuffling (kept as planned when sequential or not shuffling)."""
    lines = tree_plan.lines
    if settings.shuffle and not settings.sequential:
        perm = np.random.default_rng([int(settings.seed), int(epoch)]).permutation(len(lines)).tolist()
        lines = [lines[p] for p in perm]
    return lines


def plan_trees(examples: Sequence[Example], settings: LoaderSettings, pack_length: int) -> TreePlan:
    """The lines of tries of every epoch (`plan_tree_lines`): examples in trie order, or file order when
    sequential."""
    return plan_tree_lines(examples, pack_length, list(range(len(examples))) if settings.sequential else None)


def step_pair_totals(examples: Sequence[Example], plan: Plan, grad_accum: int) -> list[int]:
    """Preference pairs in each optimizer step over all ranks: micro-batches are grouped in runs of
    `grad_accum` (the last run may be shorter), exactly as `transformers.Trainer` groups them."""
    per_mb = [
        sum(len(examples[e].pairs) for rank_plan in plan for line in rank_plan[m] for e in line)
        for m in range(len(plan[0]))
    ]
    return [sum(per_mb[s : s + grad_accum]) for s in range(0, len(per_mb), grad_accum)]


def empty_batch(pad_token_id: int = 0, pad_multiple: int = 1) -> Batch:
    """A one-token batch with no responses: runs the model (for DDP) and weighs nothing.

    The token is a trie of its own (not padding), so it attends to itself like a real token; targets, responses and
    pairs are empty."""
    none = torch.zeros(0, dtype=torch.long)
    one = Batch(input_ids=torch.full((1, 1), pad_token_id, dtype=torch.long),
                position_ids=torch.zeros((1, 1), dtype=torch.long), spans=torch.tensor([[[0, 1]]]),
                target_line=none, target_col=none, target_ids=none, target_response=none, response_line=none,
                response_last=none, response_lengths=none, pair_better=none, pair_worse=none, max_sequence_length=1)
    return padded(one, pad_multiple, pad_token_id)


def stand_in_batch(pad_token_id: int = 0, pad_multiple: int = 1) -> Batch:
    """One line of three tokens, a 1-token prompt and two 1-token responses, and no pair: what a rank-balancing empty
    micro-batch of DPO training runs at zero weight. Unlike `empty_batch` it has response tokens, so the policy's
    pass calls every module a micro-batch with pairs calls, its LM head on response rows included (engines that
    gather a module's weights at each call, FSDP2's final-norm + head unit and ZeRO-3, need the same calls on
    every rank)."""
    return build_batch([Example((pad_token_id,), ((pad_token_id,), (pad_token_id,)), pairs=())],
                       pad_multiple=pad_multiple)


MARGIN = "margin"  # `Example.meta` key of a record's reward margin (TRL's `margin` column, reward models)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the loader builds it; never changed afterwards (what an optimizer step works out for
    it, such as a pre-pass's reference sums or the step context, goes beside it, never into it).

    batch:           the `Batch` (B lines of length L, R responses, P preference pairs)
    example_ids:     [E] long, the batch's examples (indices into the loader's examples), in batch order
    step_pairs:      preference pairs in this micro-batch's whole optimizer step over all ranks (the loss's divisor)
    real_tokens:     tokens that are not padding; slots: B x L
    shared_tokens:   tokens of the examples' rows as run (tree lines: their tries' tokens); unshared_tokens: as standard paired DPO runs them
                     (equal when prefix sharing is off)
    ref_logps:       [R] fp32 reference log-prob sums from a precomputed table, in the batch's response order;
                     None without a table
    margins:         [P] fp32 reward margins of the pairs (each example's `meta["margin"]`, 0 where unset), or
                     None when no example of the batch has one (TRL's reward loss without the term)
    """

    batch: Batch
    example_ids: torch.Tensor
    step_pairs: int
    real_tokens: int = 0
    slots: int = 0
    shared_tokens: int = 0
    unshared_tokens: int = 0
    ref_logps: torch.Tensor | None = None
    margins: torch.Tensor | None = None

    def token_counts(self) -> dict[str, int]:
        """The token counts the metric sums add up (`training.metrics.COUNTS`)."""
        return {"real_tokens": self.real_tokens, "slots": self.slots, "shared_tokens": self.shared_tokens,
                "unshared_tokens": self.unshared_tokens}

    def pin_memory(self) -> "MicroBatch":
        """A copy with every tensor page-locked (`DataLoader(pin_memory=True)` calls this)."""
        pinned = {name: getattr(self, name).pin_memory() for name in ("batch", "example_ids", "ref_logps", "margins")
                  if getattr(self, name) is not None}
        return replace(self, **pinned)


def pair_margins(examples: Sequence[Example]) -> torch.Tensor | None:
    """Margins [P] of the pairs of `examples` (example by example, each example's pairs in order), or None when
    no example has one. `meta["margin"]` is one number for every pair of the example (a record's margin), or
    one per pair (an example grouped from several records, `data.grouping`)."""
    if not any(MARGIN in ex.meta for ex in examples):
        return None
    margins = []
    for ex in examples:
        margin = ex.meta.get(MARGIN, 0.0)
        margins.extend(margin if isinstance(margin, (tuple, list)) else [margin] * len(ex.pairs))
    return torch.tensor(margins, dtype=torch.float32)


class MicroBatches(torch.utils.data.Dataset):
    """This rank's micro-batches of the current epoch, as a map-style dataset (item m = `MicroBatch` m).

    Map-style so `transformers.Trainer` can skip already-trained micro-batches on resume. Call
    `set_epoch(e)` before each epoch: the plan is re-drawn with (seed, e). The number of micro-batches
    is fixed at the first epoch's (best-fit packing makes it the same every epoch; if a plan ever
    differs, it is padded with zero-weight micro-batches or its extra lines folded into the last ones).
    """

    def __init__(self, examples: Sequence[Example], settings: LoaderSettings, rank: int = 0, world_size: int = 1,
                 ref_table=None, plan_settings: LoaderSettings | None = None):
        if not examples:
            raise UserError("no examples to train or evaluate on (the dataset is empty)")
        self.examples = list(examples)
        self.settings = settings
        # plan as if with `plan_settings`, lay out with `settings` (lets a test run standard rows on
        # exactly the example groups of a packed prefix-shared plan)
        self.plan_settings = plan_settings or settings
        self.rank, self.world_size = int(rank), int(world_size)
        self.ref_table = ref_table  # precomputed reference sums (reference.RefLogpsTable) or None
        self.pack_length = resolve_pack_length(self.examples, self.plan_settings)
        # tries are planned once: their lines are the same every epoch (only their order changes)
        self.tree_plan = None
        if self.plan_settings.packing and self.plan_settings.prefix_tree:
            _check_rows_fit(self.examples, [row_length(ex, True) for ex in self.examples], self.pack_length)
            self.tree_plan = plan_trees(self.examples, self.plan_settings, self.pack_length)
            logging.getLogger(__name__).info("%s", self.tree_plan.summary())
        self.epoch = -1
        self._length: int | None = None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        if epoch == self.epoch:
            return
        plan = plan_epoch(self.examples, self.plan_settings, epoch, self.world_size, self.pack_length, self.tree_plan)
        if self._length is None:
            self._length = len(plan[0])
        plan = [_fit(rank_plan, self._length) for rank_plan in plan]
        self.epoch = epoch
        self.plan = plan
        self.step_pairs = step_pair_totals(self.examples, plan, self.settings.grad_accum)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, m: int) -> MicroBatch:
        lines = self.plan[self.rank][m]
        ids = [e for line in lines for e in line]
        total = self.step_pairs[m // self.settings.grad_accum]
        if not ids:
            return MicroBatch(empty_batch(self.settings.pad_token_id, self.settings.pad_multiple),
                              torch.zeros(0, dtype=torch.long), total)
        exs = [self.examples[e] for e in ids]
        batch = self._layout(exs, lines)
        example_ids = torch.tensor(ids, dtype=torch.long)
        return MicroBatch(
            batch, example_ids, total,
            real_tokens=batch.num_real_tokens,
            slots=batch.num_slots,
            shared_tokens=batch.num_real_tokens if self.settings.prefix_tree else sum(
                row_length(ex, self.settings.prefix_sharing) for ex in exs),
            unshared_tokens=sum(ex.unshared_length for ex in exs),
            ref_logps=None if self.ref_table is None else self.ref_table.gather(example_ids),
            margins=pair_margins(exs),
        )

    def _layout(self, exs: list[Example], lines: list[list[int]]) -> Batch:
        """The Batch of one micro-batch's examples `exs` (planned as `lines` of example indices)."""
        if self.settings.packing and self.plan_settings.packing:
            # packs as local indices
            local, k = [], 0
            for line in lines:
                local.append(list(range(k, k + len(line))))
                k += len(line)
            if self.settings.prefix_tree:
                return build_tree_batch(exs, [p for p in local if p], pad_token_id=self.settings.pad_token_id,
                                        length=self.pack_length)
            return build_batch(exs, prefix_sharing=self.settings.prefix_sharing, packs=[p for p in local if p],
                               pad_token_id=self.settings.pad_token_id, length=self.pack_length)
        return build_batch(exs, prefix_sharing=self.settings.prefix_sharing, packs=None,
                           pad_token_id=self.settings.pad_token_id, pad_multiple=self.settings.pad_multiple,
                           bucket=self.settings.bucket)


def _fit(micro_batches: list, length: int) -> list:
    """Pad with empty micro-batches, or fold surplus lines into the last ones, to exactly `length`."""
    out = [list(mb) for mb in micro_batches[:length]]
    for i, extra in enumerate(micro_batches[length:]):
        out[-1 - (i % len(out))].extend(extra)
    out.extend([[]] for _ in range(length - len(out)))
    return out


def _first(items: list[MicroBatch]) -> MicroBatch:
    return items[0]


def make_dataloader(dataset: MicroBatches, num_workers: int = 0, pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader yielding one `MicroBatch` per step (batch_size=1 + unwrap, so resume can skip)."""
    return torch.utils.data.DataLoader(
        dataset, batch_size=1, shuffle=False, collate_fn=_first, num_workers=num_workers, pin_memory=pin_memory
    )
