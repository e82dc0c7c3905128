"""The log-prob passes of a TRL group trainer on prefix-shared rows: `GroupPasses`, which the trainer's one override
of TRL's `_get_per_token_logps_and_entropies` calls (`trainer.py` says why that method), built once per run with what
it reads: the run's prefix sharing (`training.sharing_run.SharingRun`: backend, sequence-parallel group, reuse
budget, notes said once, sharing counts), the accelerator (its autocast) and TRL's sampling temperature. The
trainer's options (`settings.GroupSettings`, which verification and benchmarks change on a live trainer) come with
each call.

- The rows are grouped by their prompt tokens (TRL shuffles rows between generation and training, so row order says
  nothing), each group runs as one prefix-shared row, groups are packed into lines (`layout.py`), and the results are
  scattered back to TRL's tensors (`logps.py`).
- A pass prefix sharing cannot reproduce exactly (images and other multimodal inputs, token type ids, a completion
  mask with a gap, a sliding window shorter than the rows on a backend that does not slide it, a model not running
  prefixdpo's attention) runs TRL's own
  method instead (`trl_pass`, handed in by the trainer), and the first time each reason occurs it is said once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixdpo.core.attention.backends import ATTENTION_NAME, WINDOWED_BACKENDS
from prefixdpo.core.model_checks import base_model, sliding_window_of, text_config
from prefixdpo.core.one_pass import refuse_unbuilt
from prefixdpo.data.lines import padded
from prefixdpo.grpo.layout import MASK_POSITION_MODEL_TYPES, GroupLines, layout_groups, why_not_shared
from prefixdpo.grpo.logps import group_logps, trl_head_settings
from prefixdpo.grpo.settings import GroupSettings, LayoutKey

__all__ = ["CachedLayout", "GroupPasses"]


@dataclass(frozen=True)
class CachedLayout:
    """The lines of the last pass over some rows (`GroupPasses.lines`): its key, its rows [N, L], its lines."""

    key: LayoutKey
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lines: GroupLines

    def serves(self, key: LayoutKey, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
        return key == self.key and _same(self.input_ids, input_ids) and _same(self.attention_mask, attention_mask)


class GroupPasses:
    """A group trainer's log-prob passes on prefix-shared lines (module docstring)."""

    def __init__(self, sharing, accelerator, temperature: float):
        self.sharing = sharing
        self.accelerator = accelerator
        self.temperature = temperature
        self.layouts: dict[int, CachedLayout] = {}  # per slot: the last pass's lines (`lines`)
        self.last_layout: CachedLayout | None = None

    def logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
              multimodal: dict, *, settings: GroupSettings, mode: str, trl_pass):
        """TRL's (log-probs [N, K], entropies or None, aux loss or None) of the rows [N, L], on prefix-shared lines
        where they reproduce TRL's pass, else by `trl_pass` (TRL's own method, same arguments). mode: train / eval,
        whose sharing counts the lines add to."""
        if self.sharing.sequence_parallel is not None:
            return self.group_passes(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                     compute_aux_loss, multimodal, settings=settings, mode=mode, trl_pass=trl_pass)
        reason = self.why_trl_pass(model, input_ids, attention_mask, logits_to_keep, multimodal)
        if reason is not None:
            self.note_fallback(reason)
            return trl_pass(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                            compute_aux_loss, **multimodal)
        return self.shared_pass(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                compute_aux_loss, settings=settings, mode=mode)

    def shared_pass(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                    compute_aux_loss, *, settings: GroupSettings, mode: str | None, sp=None, slot: int = 0):
        """TRL's (log-probs [N, K], entropies or None, aux loss or None) of rows [N, L] on prefix-shared lines; with
        `sp`, every rank of its group runs these rows, each 1/N of every line's columns. mode: whose sharing counts
        the lines add to (None: not counted; under sequence parallelism only the rank whose rows they are counts
        them); slot: `lines`'."""
        backend = self.sharing.backend_for(input_ids.device, needs_grad=torch.is_grad_enabled())
        lines = self.lines(model, input_ids, attention_mask, logits_to_keep, backend, settings, sp, slot)
        N, L = input_ids.shape
        rows_per_forward = batch_size or N
        # TRL averages the aux loss over its forwards of `batch_size` rows: the same row sets, here
        aux_rows = ([torch.arange(s, min(s + rows_per_forward, N), device=input_ids.device)
                     for s in range(0, N, rows_per_forward)] if compute_aux_loss else None)
        head = trl_head_settings(model, self.temperature, settings.cast_lm_head_to_fp32)
        with self.accelerator.autocast():
            result = group_logps(model, lines, head, backend=backend, max_slots=rows_per_forward * L,
                                 compute_entropy=compute_entropy, aux_row_chunks=aux_rows,
                                 tokens_per_pass=self.sharing.tokens_per_pass, sp=sp)
        if mode is not None:
            self.sharing.counts.count_lines(mode, lines)
        return result

    def group_passes(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                     compute_aux_loss, multimodal, *, settings: GroupSettings, mode: str, trl_pass):
        """The pass under sequence parallelism: TRL deals different rows to the ranks of a group, so the group runs
        each member's rows in turn, all together (each rank 1/N of every line's columns, `shared_pass`), and keeps
        its own. Each rank's result also depends (times 0) on the other members' passes, so every rank runs the
        same backward, collectives in the same order; their backward sums bring each member's gradient to every rank
        (`core.sequence_parallel`), and DDP's average over ranks is then that of TRL's data-parallel run."""
        sp = self.sharing.sequence_parallel
        refuse_unbuilt(reuse=False, sp=sp, router_logits=compute_aux_loss)  # before the group's collectives
        reason = self.why_trl_pass(model, input_ids, attention_mask, logits_to_keep, multimodal)
        members: list = [None] * sp.size
        torch.distributed.all_gather_object(
            members, (input_ids.cpu(), attention_mask.cpu(), int(logits_to_keep), reason is None), group=sp.group)
        mine, others = None, []
        for member, (ids, mask, keep, shared) in enumerate(members):
            if not shared:  # TRL's own pass of that member's rows, on that rank alone
                if member == sp.rank:
                    self.note_fallback(reason)
                    mine = trl_pass(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                    False, **multimodal)
                continue
            if member == sp.rank:
                ids, mask = input_ids, attention_mask
            out = self.shared_pass(model, ids.to(input_ids.device), mask.to(input_ids.device), keep, batch_size,
                                   compute_entropy, False, settings=settings,
                                   mode=mode if member == sp.rank else None, sp=sp, slot=member)
            if member == sp.rank:
                mine = out
            else:
                others.extend(t for t in out if t is not None)
        logps, entropies, aux = mine
        if others and logps.requires_grad:
            logps = logps + sum(t.sum() for t in others) * 0.0
        return logps, entropies, aux

    def lines(self, model, input_ids, attention_mask, logits_to_keep, backend: str, settings: GroupSettings, sp=None,
              slot: int = 0) -> GroupLines:
        """The lines of this pass; the previous pass's (and the masks built for them) when its rows are the same:
        TRL runs the reference and old-policy passes on the same rows, and the policy pass on rows of equal
        content, so one layout and one set of masks serve them all (as the DPO step shares its mask). slot: whose
        rows (under sequence parallelism each member's rows keep their own layout, `group_passes`)."""
        model_type = getattr(text_config(base_model(model)), "model_type", "")
        key = LayoutKey(logits_to_keep=int(logits_to_keep),
                        positions_from_mask=model_type in MASK_POSITION_MODEL_TYPES, packing=settings.packing,
                        pack_length=str(settings.pack_length), bucketed=backend in ("flex", "varlen"),
                        tokens_per_pass=self.sharing.tokens_per_pass, shards=1 if sp is None else sp.size)
        cached = self.layouts.get(slot)
        if cached is not None and cached.serves(key, input_ids, attention_mask):
            self.last_layout = cached
            return cached.lines
        lines = layout_groups(
            input_ids, attention_mask, key.logits_to_keep, positions_from_mask=key.positions_from_mask,
            packing=key.packing, pack_length=settings.pack_length, bucket=key.bucketed, alone_above=key.tokens_per_pass)
        if sp is not None:  # each rank of the group holds an equal share of every line's columns
            lines = padded(lines, key.shards)
        self.last_layout = self.layouts[slot] = CachedLayout(key, input_ids.detach().clone(),
                                                             attention_mask.detach().clone(), lines)
        return lines

    def why_trl_pass(self, model, input_ids, attention_mask, logits_to_keep, multimodal: dict) -> str | None:
        """Why this pass must run TRL's own layout (None: prefix sharing reproduces it exactly)."""
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            return f"the rows come with {', '.join(given)}, which prefix sharing does not lay out"
        if input_ids.shape[0] == 0:
            return "the pass has no rows"
        base = base_model(model)
        if getattr(base.config, "_attn_implementation", None) != ATTENTION_NAME:
            return (f"{type(base).__name__} does not run prefixdpo's attention (it was not passed in as the policy "
                    "or the reference)")
        window = sliding_window_of(base)
        slides = self.sharing.backend_for(input_ids.device, needs_grad=False) in WINDOWED_BACKENDS
        if window is not None and input_ids.shape[1] > window and not slides:  # the dense mask slides it
            return f"rows of {input_ids.shape[1]} columns exceed the model's sliding window of {window}"
        return why_not_shared(attention_mask, logits_to_keep)

    def note_fallback(self, reason: str) -> None:
        self.sharing.note("prefix sharing", reason, "such passes run TRL's own layout")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.device == b.device and torch.equal(a, b)
