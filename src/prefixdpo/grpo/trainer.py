"""`PrefixGRPOTrainer` / `PrefixRLOOTrainer`: TRL 1.16's `GRPOTrainer` / `RLOOTrainer` whose per-token log-prob
passes run on prefix-shared rows, whose transformers generation prefills each prompt once, and whose reward models
score each prompt's completions on one shared line.

Everything else is TRL's own code: the generation loop and its config, reward functions, advantages, every loss
type, clipping, importance sampling, KL, entropy masks and bonus, logging, tool-call masks. Generation and reward
models are each one call routed inside TRL's own method (`rollout.py`: `generate` in `_generate_single_turn`, the
reward model's forward in `_calculate_rewards`; options `shared_prompt_generation`, `shared_prompt_scoring`). For
the log-probs, only the one method through which TRL computes *every* pass is replaced,
`_get_per_token_logps_and_entropies`:

- It is the narrowest point that sees all three passes (the policy with gradient in `_compute_loss`, the
  old policy and the reference in `_generate_and_score_completions`), in both trainers, with one contract:
  rows ``[left-padded prompt][right-padded completion]`` in, ``([rows, logits_to_keep] log-probs,
  entropies or None, MoE aux loss or None)`` out, zero at masked columns. That contract is what TRL's own
  loss code reads, so it cannot change without TRL changing its callers in the same release; the method
  has kept its name and shape through TRL 1.x, and the signature here accepts every argument TRL 1.16
  passes (keyword or positional).
- The rows are grouped by their prompt tokens (TRL shuffles rows between generation and training, so row
  order says nothing), each group runs as one prefix-shared row, groups are packed into lines
  (`layout.py`), and the results are scattered back to TRL's tensors (`logps.py`).
- A pass prefix sharing cannot reproduce exactly (images and other multimodal inputs, token type ids, a
  completion mask with a gap, a sliding window shorter than the rows, a model not running prefixdpo's
  attention) runs TRL's own method instead, and the first time each reason occurs it is logged once.

Runs survive as DPO runs do (`training.survival.SurvivingRun`, mixed in between this class and TRL's): staged
checkpoints sealed with the run's fingerprint (the model, every prompt record and the reward functions' names,
the trajectory options), `resume_from_checkpoint="latest"`, another run's output_dir refused, SIGTERM/SIGUSR1 ->
checkpoint + `TrainingPreempted`, the non-finite guard on TRL's loss and gradient norm, staged exports; a reward
function that raises or breaks TRL's contract stops the run in one line, and a step with no usable reward (all
None/NaN, or any inf) is a non-finite step (`reward_checks.py`).

A resume continues the uninterrupted run exactly when its checkpoint ends a generation cycle (every checkpoint
with TRL's defaults `steps_per_generation` = `gradient_accumulation_steps`, `num_iterations` = 1): generation
draws from the global torch RNG, which Trainer saves in every checkpoint and restores; the prompt order is TRL's
seeded `RepeatSampler`'s, made resumable (`EpochRepeatSampler`: TRL's draws one permutation per pass from a
generator seeded once, so a run resumed in epoch e drew epoch 0's order); TRL's micro-step counter is saved.
TRL's buffered completions are not: resumed inside a cycle, it generates the rest of the cycle anew (said once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from trl import GRPOTrainer, RLOOTrainer
from trl.extras.profiling import profiling_decorator
from trl.trainer.utils import RepeatSampler

from prefixdpo.core import sequence_parallel
from prefixdpo.core.fingerprints import records_fingerprint
from prefixdpo.data.lines import padded
from prefixdpo.core.attention.backends import ATTENTION_NAME, WINDOWED_BACKENDS, resolve_backend
from prefixdpo.core.model_checks import (
    backend_for_model, base_model, check_recurrent_options, prepare_model, sliding_window_of, text_config,
)
from prefixdpo.training.settings import apply_engine_settings
from prefixdpo.training.options import resolve_tokens_per_pass
from prefixdpo.training.survival import SurvivingRun
from prefixdpo.grpo.layout import MASK_POSITION_MODEL_TYPES, GroupLines, layout_groups, why_not_shared
from prefixdpo.grpo.rollout import SharedPromptGeneration, SharedPromptScoring
from prefixdpo.core.one_pass import refuse_unbuilt
from prefixdpo.grpo.logps import group_logps, trl_head_settings
from prefixdpo.grpo.reward_checks import GuardedRewards
from prefixdpo.grpo.run_notes import SaidOnce, SharingCounts
from prefixdpo.grpo.prompt_fit import check_prompts_fit
from prefixdpo.grpo.settings import GroupSettings, LayoutKey
from prefixdpo.errors import ConfigError

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class CachedLayout:
    """The lines of the last pass over some rows (`PrefixSharedLogps._lines`): its key, its rows [N, L], its lines."""

    key: LayoutKey
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lines: GroupLines

    def serves(self, key: LayoutKey, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
        return key == self.key and _same(self.input_ids, input_ids) and _same(self.attention_mask, attention_mask)


def check_trl_aux_loss(model, enabled: bool, coef: float) -> None:
    """Refuse in one line a MoE load-balancing loss TRL 1.16's GRPO/RLOO passes would crash on (an AttributeError in
    `trl.trainer.utils`' fused head): it reads `num_experts` from the text config, which Granite 4 hybrid's lacks
    (it names num_local_experts)."""
    cfg = text_config(base_model(model))
    if enabled and not hasattr(cfg, "num_experts"):
        raise ConfigError(f"router_aux_loss_coef={coef}: TRL 1.16's GRPO/RLOO passes read num_experts from the model "
                          f"config, which {type(cfg).__name__} does not have; set --router_aux_loss_coef 0")


class PrefixSharedLogps:
    """The log-prob passes of a TRL group trainer on prefix-shared rows (mixed in before the TRL class)."""

    @cached_property
    def group_settings(self) -> GroupSettings:
        """prefixdpo's options of this trainer, read once from its config (`grpo.settings`)."""
        return GroupSettings.from_config(self.args)

    def change_settings(self, **changes) -> None:
        """Run the passes from now on with these `GroupSettings` fields changed (verification and benchmarks
        compare layouts on one trainer); the config is left as it is."""
        self.group_settings = replace(self.group_settings, **changes)

    def _setup_prefix_sharing(self) -> None:
        """After TRL's `__init__`: switch the policy and reference to prefixdpo's attention, or refuse them."""
        self.tokens_per_pass: int | None = None  # prefix reuse's budget (`core.prefix_reuse`), or None
        settings = self.group_settings
        size = settings.sequence_parallel_size
        if size > 1:
            sequence_parallel.check_model(self.model, size)
        self.sequence_parallel = sequence_parallel.new_sequence_parallel(size)
        if not settings.prefix_sharing:  # TRL's own passes, on the model's own attention
            check_trl_aux_loss(self.model, getattr(self, "aux_loss_enabled", False), self.router_aux_loss_coef)
            return
        resolved = resolve_backend(settings.attention, self.args.device, needs_grad=True)
        backend = backend_for_model(self.model, resolved, settings.attention)
        if backend != resolved:  # auto's sdpa for a model without flex: every pass (and the scoring) runs it
            self.change_settings(attention=backend)
        for model in (self.model, self.ref_model):
            if model is not None:
                prepare_model(model, backend)
        check_recurrent_options(self.model, sequence_parallel_size=size)
        if settings.prefix_reuse:
            self.tokens_per_pass = resolve_tokens_per_pass(self.args, self.model)

    # ---- the pass -------------------------------------------------------------------------------

    @profiling_decorator
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's per-token log-probs [N, logits_to_keep] (and entropies, and the MoE aux loss, when asked) of the
        rows ``input_ids`` / ``attention_mask`` [N, L], computed on prefix-shared lines (see the module doc)."""
        if not self.group_settings.prefix_sharing:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        if self.sequence_parallel is not None:
            return self._group_passes(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                      compute_aux_loss, multimodal)
        reason = self._why_trl_pass(model, input_ids, attention_mask, logits_to_keep, multimodal)
        if reason is not None:
            self._note_fallback(reason)
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        return self._shared_pass(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                 compute_aux_loss)

    def _shared_pass(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                     compute_aux_loss, sp=None, count: bool = True, slot: int = 0):
        """TRL's (log-probs [N, K], entropies or None, aux loss or None) of rows [N, L] on prefix-shared lines; with
        `sp`, every rank of its group runs these rows, each 1/N of every line's columns. count: add the lines to the
        sharing metrics (under sequence parallelism only the rank whose rows they are does); slot: `_lines`'."""
        backend = resolve_backend(self.group_settings.attention, input_ids.device,
                                  needs_grad=torch.is_grad_enabled())
        lines = self._lines(model, input_ids, attention_mask, logits_to_keep, backend, sp, slot)
        N, L = input_ids.shape
        rows_per_forward = batch_size or N
        # TRL averages the aux loss over its forwards of `batch_size` rows: the same row sets, here
        aux_rows = ([torch.arange(s, min(s + rows_per_forward, N), device=input_ids.device)
                     for s in range(0, N, rows_per_forward)] if compute_aux_loss else None)
        settings = trl_head_settings(model, self.temperature, self.group_settings.cast_lm_head_to_fp32)
        with self.accelerator.autocast():
            result = group_logps(model, lines, settings, backend=backend, max_slots=rows_per_forward * L,
                                 compute_entropy=compute_entropy, aux_row_chunks=aux_rows,
                                 tokens_per_pass=self.tokens_per_pass, sp=sp)
        if count:
            self._count_sharing(lines)
        return result

    def _group_passes(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                      compute_aux_loss, multimodal):
        """The pass under sequence parallelism: TRL deals different rows to the ranks of a group, so the group runs
        each member's rows in turn, all together (each rank 1/N of every line's columns, `_shared_pass`), and keeps
        its own. Each rank's result also depends (times 0) on the other members' passes, so every rank runs the
        same backward, collectives in the same order; their backward sums bring each member's gradient to every rank
        (`core.sequence_parallel`), and DDP's average over ranks is then that of TRL's data-parallel run."""
        sp = self.sequence_parallel
        refuse_unbuilt(reuse=False, sp=sp, router_logits=compute_aux_loss)  # before the group's collectives
        reason = self._why_trl_pass(model, input_ids, attention_mask, logits_to_keep, multimodal)
        members: list = [None] * sp.size
        torch.distributed.all_gather_object(
            members, (input_ids.cpu(), attention_mask.cpu(), int(logits_to_keep), reason is None), group=sp.group)
        mine, others = None, []
        for member, (ids, mask, keep, shared) in enumerate(members):
            if not shared:  # TRL's own pass of that member's rows, on that rank alone
                if member == sp.rank:
                    self._note_fallback(reason)
                    mine = super()._get_per_token_logps_and_entropies(
                        model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, False,
                        **multimodal)
                continue
            if member == sp.rank:
                ids, mask = input_ids, attention_mask
            out = self._shared_pass(model, ids.to(input_ids.device), mask.to(input_ids.device), keep, batch_size,
                                    compute_entropy, False, sp, count=member == sp.rank, slot=member)
            if member == sp.rank:
                mine = out
            else:
                others.extend(t for t in out if t is not None)
        logps, entropies, aux = mine
        if others and logps.requires_grad:
            logps = logps + sum(t.sum() for t in others) * 0.0
        return logps, entropies, aux

    def _lines(self, model, input_ids, attention_mask, logits_to_keep, backend: str, sp=None,
               slot: int = 0) -> GroupLines:
        """The lines of this pass; the previous pass's (and the masks built for them) when its rows are the same:
        TRL runs the reference and old-policy passes on the same rows, and the policy pass on rows of equal
        content, so one layout and one set of masks serve them all (as the DPO step shares its mask). slot: whose
        rows (under sequence parallelism each member's rows keep their own layout, `_group_passes`)."""
        model_type = getattr(text_config(base_model(model)), "model_type", "")
        options = self.group_settings
        key = LayoutKey(logits_to_keep=int(logits_to_keep),
                        positions_from_mask=model_type in MASK_POSITION_MODEL_TYPES, packing=options.packing,
                        pack_length=str(options.pack_length), bucketed=backend in ("flex", "varlen"),
                        tokens_per_pass=self.tokens_per_pass, shards=1 if sp is None else sp.size)
        layouts: dict[int, CachedLayout] = self.__dict__.setdefault("_layouts", {})
        cached = layouts.get(slot)
        if cached is not None and cached.serves(key, input_ids, attention_mask):
            self._last_layout = cached
            return cached.lines
        lines = layout_groups(
            input_ids, attention_mask, key.logits_to_keep, positions_from_mask=key.positions_from_mask,
            packing=key.packing, pack_length=options.pack_length, bucket=key.bucketed, alone_above=key.tokens_per_pass)
        if sp is not None:  # each rank of the group holds an equal share of every line's columns
            lines = padded(lines, key.shards)
        self._last_layout = layouts[slot] = CachedLayout(key, input_ids.detach().clone(),
                                                         attention_mask.detach().clone(), lines)
        return lines

    def _why_trl_pass(self, model, input_ids, attention_mask, logits_to_keep, multimodal: dict) -> str | None:
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
        slides = resolve_backend(self.group_settings.attention, input_ids.device, needs_grad=False) in WINDOWED_BACKENDS
        if window is not None and input_ids.shape[1] > window and not slides:  # the dense mask slides it
            return f"rows of {input_ids.shape[1]} columns exceed the model's sliding window of {window}"
        return why_not_shared(attention_mask, logits_to_keep)

    def _note_fallback(self, reason: str) -> None:
        self.said_once("prefix sharing", reason, "such passes run TRL's own layout")

    # ---- what sharing saved -----------------------------------------------------------------------

    def _count_sharing(self, lines: GroupLines) -> None:
        self.sharing_counts.count_lines("train" if self.model.training else "eval", lines)

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        # exactly TRL's RepeatSampler (same order in an uninterrupted run), resumable (`EpochRepeatSampler`)
        return EpochRepeatSampler.of(sampler) if type(sampler) is RepeatSampler else sampler

    # ---- engines, survival -----------------------------------------------------------------------

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        apply_engine_settings(self, self.group_settings.safety.nonfinite)  # FSDP, prefix reuse on it, nonfinite

    def _checkpoint_state(self) -> dict:
        # TRL's micro-step counter, which places a step in its generation cycle (`_prepare_inputs`)
        return {"micro_step": int(self._step)}

    def _restore_checkpoint_state(self, state: dict) -> None:
        self._step = int(state.get("micro_step", 0))
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every:
            # TRL keeps the completions of a generation cycle in memory only (`_buffered_inputs`): resumed inside
            # one, it generates them anew for the rest of the cycle, so the run goes on from the checkpoint but
            # is not the uninterrupted run's trajectory (that needs a checkpoint at a cycle boundary).
            logger.warning("resumed inside a generation cycle (micro-step %d of every %d): TRL generates the "
                           "completions of the rest of this cycle anew; save_steps at a multiple of the cycle "
                           "resumes exactly", self._step, generate_every)

    def _fingerprint_data(self) -> str:
        """Every prompt record of the training set, in order, and the reward functions' names (what the run
        learns from); an iterable dataset cannot be read twice, so only its type counts."""
        data = self.train_dataset
        names = [str(n) for n in getattr(self, "reward_func_names", [])]
        if data is None or not hasattr(data, "__len__"):
            return records_fingerprint([], [type(data).__name__, *names])
        return records_fingerprint(data, names)


class EpochRepeatSampler(RepeatSampler):
    """TRL's `RepeatSampler` with `set_epoch`: epoch e's prompt order is the one TRL's sampler draws in its
    (e+1)-th pass (the generator re-seeded, e permutations drawn and dropped), so a run resumed in epoch e
    samples what the uninterrupted run sampled. accelerate's data loader and Trainer call `set_epoch` before
    every epoch's pass."""

    @classmethod
    def of(cls, sampler: RepeatSampler) -> "EpochRepeatSampler":
        return cls(sampler.data_source, sampler.mini_repeat_count, sampler.batch_size, sampler.repeat_count,
                   sampler.shuffle, sampler.seed)

    def set_epoch(self, epoch: int) -> None:
        if not self.shuffle or self.seed is None:  # unseeded: no order to reproduce
            return
        self.generator.manual_seed(self.seed)
        for _ in range(epoch):
            torch.randperm(self.num_samples, generator=self.generator)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.device == b.device and torch.equal(a, b)


class PrefixGroupTrainer(PrefixSharedLogps, SharedPromptGeneration, SharedPromptScoring, GuardedRewards, SurvivingRun):
    """What prefixdpo adds to a TRL group trainer (mixed in before it): log-prob passes on prefix-shared rows,
    shared-prompt generation and reward-model scoring (`rollout.py`), reward functions that cannot end a run silently
    wrong (`GuardedRewards`), and runs that survive (`SurvivingRun`), each set up after TRL's `__init__`."""

    def __init__(self, *args, record_indices: dict | None = None, **kwargs):
        """TRL's arguments; record_indices (ours): {"train" / "eval" / an eval dataset's name: the source record
        index of each row}, for messages naming a record, where rows are not the source's records (some skipped)."""
        self.said_once = SaidOnce(logger)  # why a pass, a generate call or a reward-model call ran TRL's way
        self.sharing_counts = SharingCounts()  # what the passes and the prefill saved, drained by `log`
        super().__init__(*args, **kwargs)
        check_prompts_fit(self, record_indices)  # before any work: a prompt past the model's positions, one line
        self._setup_prefix_sharing()
        self._setup_shared_generation()
        self._setup_shared_scoring()
        self._guard_reward_funcs()
        self._init_survival()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with what prefix sharing saved since the last one (`run_notes.SharingCounts.drain`)."""
        mode = "train" if self.model.training else "eval"
        settings = self.group_settings
        saved = self.sharing_counts.drain(mode, self.accelerator, passes=settings.prefix_sharing,
                                          prefill=settings.shared_prompt_generation)
        for name, value in saved.items():
            self._metrics[mode][name].append(value)
        super().log(logs, start_time)


class PrefixGRPOTrainer(PrefixGroupTrainer, GRPOTrainer):
    """TRL's `GRPOTrainer` (same arguments) with what `PrefixGroupTrainer` adds."""


class PrefixRLOOTrainer(PrefixGroupTrainer, RLOOTrainer):
    """TRL's `RLOOTrainer` (same arguments) with what `PrefixGroupTrainer` adds."""
