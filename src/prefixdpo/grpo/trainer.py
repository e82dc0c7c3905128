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
- Its passes are `passes.GroupPasses`' (rows grouped by prompt, packed into lines, scattered back; TRL's own
  method where sharing cannot reproduce a pass, each reason said once).

What prefixdpo adds is one class, `PrefixGroupTrainer`, mixed in before TRL's (with `SurvivingRun`): it holds one
object per concern, each built once after TRL's `__init__` with what it reads, and its overrides of TRL's methods
call them: the run's prefix sharing (`sharing`: `training.sharing_run.SharingRun`, the backend, the
sequence-parallel group, the reuse budget, the notes said once and the sharing counts its one `log` drains), the
passes (`passes`), generation and reward-model scoring (`generation`, `scoring`: `rollout.py`) and the reward
checks (`reward_guard`: `reward_checks.py`).

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

import functools
import logging
from dataclasses import replace
from functools import cached_property

import torch
from trl import GRPOTrainer, RLOOTrainer
from trl.extras.profiling import profiling_decorator
from trl.trainer.utils import RepeatSampler

from prefixdpo.core.fingerprints import records_fingerprint
from prefixdpo.core.attention.backends import resolve_backend
from prefixdpo.core.model_checks import (
    backend_for_model, base_model, check_recurrent_options, prepare_model, text_config,
)
from prefixdpo.training.settings import apply_engine_settings
from prefixdpo.training.options import resolve_tokens_per_pass
from prefixdpo.training.sharing_run import SaidOnce, start_sharing
from prefixdpo.training.survival import SurvivingRun
from prefixdpo.grpo.passes import GroupPasses
from prefixdpo.grpo.rollout import SharedGeneration, SharedScoring, _say_vllm_prefix_caching
from prefixdpo.grpo.reward_checks import RewardGuard
from prefixdpo.grpo.run_notes import SharingCounts
from prefixdpo.grpo.prompt_fit import check_prompts_fit
from prefixdpo.grpo.settings import GroupSettings
from prefixdpo.errors import ConfigError

logger = logging.getLogger(__name__)


def check_trl_aux_loss(model, enabled: bool, coef: float) -> None:
    """Refuse in one line a MoE load-balancing loss TRL 1.16's GRPO/RLOO passes would crash on (an AttributeError in
    `trl.trainer.utils`' fused head): it reads `num_experts` from the text config, which Granite 4 hybrid's lacks
    (it names num_local_experts)."""
    cfg = text_config(base_model(model))
    if enabled and not hasattr(cfg, "num_experts"):
        raise ConfigError(f"router_aux_loss_coef={coef}: TRL 1.16's GRPO/RLOO passes read num_experts from the model "
                          f"config, which {type(cfg).__name__} does not have; set --router_aux_loss_coef 0")


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


class PrefixGroupTrainer(SurvivingRun):
    """What prefixdpo adds to a TRL group trainer (mixed in before it, `SurvivingRun` after it; the module
    docstring): one object per concern, each built once after TRL's `__init__`, which the overrides of TRL's methods
    below call."""

    def __init__(self, *args, record_indices: dict | None = None, **kwargs):
        """TRL's arguments; record_indices (ours): {"train" / "eval" / an eval dataset's name: the source record
        index of each row}, for messages naming a record, where rows are not the source's records (some skipped)."""
        super().__init__(*args, **kwargs)
        check_prompts_fit(self, record_indices)  # before any work: a prompt past the model's positions, one line
        self._start_sharing()
        settings = self.group_settings
        self.passes = GroupPasses(self.sharing, self.accelerator, self.temperature)
        self.generation = SharedGeneration(self.sharing)
        if settings.shared_prompt_generation and getattr(self, "use_vllm", False):
            _say_vllm_prefix_caching(self)
        self.scoring = SharedScoring(self.sharing, self.reward_funcs, self.reward_func_names,
                                     enabled=settings.shared_prompt_scoring, device=self.accelerator.device)
        self.reward_guard = RewardGuard()
        self.reward_funcs = self.reward_guard.guarded(self.reward_funcs, self.reward_func_names)
        self._init_survival()

    # ---- settings and the run's prefix sharing ----------------------------------------------------

    @cached_property
    def group_settings(self) -> GroupSettings:
        """prefixdpo's options of this trainer, read once from its config (`grpo.settings`)."""
        return GroupSettings.from_config(self.args)

    def change_settings(self, **changes) -> None:
        """Run the passes from now on with these `GroupSettings` fields changed (verification and benchmarks
        compare layouts and backends on one trainer); the config is left as it is."""
        self.group_settings = replace(self.group_settings, **changes)
        if "attention" in changes:  # the backend every pass and scoring call runs is the run's
            self.sharing.backend = self.group_settings.attention

    def _start_sharing(self) -> None:
        """After TRL's `__init__`: the run's prefix sharing (`sharing`); the policy and reference switched to
        prefixdpo's attention, or refused."""
        settings = self.group_settings
        size = settings.sequence_parallel_size
        self.sharing = start_sharing(self.model, settings.attention, sequence_parallel_size=size,
                                     rank=self.args.process_index, world=self.args.world_size,
                                     said_once=SaidOnce(logger), counts=SharingCounts())
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
        if settings.prefix_reuse:  # prefix reuse's budget (`core.prefix_reuse`)
            self.sharing.tokens_per_pass = resolve_tokens_per_pass(self.args, self.model)

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    # ---- TRL's methods, each calling the object of its concern ------------------------------------

    @profiling_decorator
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's per-token log-probs [N, logits_to_keep] (and entropies, and the MoE aux loss, when asked) of the
        rows ``input_ids`` / ``attention_mask`` [N, L], computed on prefix-shared lines (`passes.GroupPasses`)."""
        trl_pass = super()._get_per_token_logps_and_entropies
        if not self.group_settings.prefix_sharing:
            return trl_pass(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                            compute_aux_loss, **multimodal)
        return self.passes.logps(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                 compute_aux_loss, multimodal, settings=self.group_settings, mode=self._mode(),
                                 trl_pass=trl_pass)

    def _generate_single_turn(self, *args, **kwargs):
        trl_generate = functools.partial(super()._generate_single_turn, *args, **kwargs)
        if (not self.group_settings.shared_prompt_generation or getattr(self, "use_vllm", False)
                or getattr(self, "use_transformers_continuous_batching", False)):
            return trl_generate()
        # the object TRL's `unwrap_model_for_generation` yields and calls `generate` on
        model = self.accelerator.unwrap_model(self.model_wrapped)
        return self.generation.generate(model, self._mode(), trl_generate)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards, its reward models scored shared (`rollout.SharedScoring`), checked (`RewardGuard`)."""
        self.reward_guard.begin()
        with self.scoring.routed(self, prompts, self.group_settings):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self.reward_guard.check(rewards, self.reward_func_names, device=self.accelerator.device,
                                       training=self.model.training, step=self.state.global_step,
                                       output_dir=self.args.output_dir, run_fingerprint=self.run_fingerprint)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
        return self.reward_guard.poisoned(loss, model, return_outputs, self.nonfinite)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with what prefix sharing saved since the last one (`SharingRun.drain`)."""
        mode = self._mode()
        settings = self.group_settings
        saved = self.sharing.drain(mode, self.accelerator, passes=settings.prefix_sharing,
                                   prefill=settings.shared_prompt_generation)
        for name, value in saved.items():
            self._metrics[mode][name].append(value)
        super().log(logs, start_time)

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


class PrefixGRPOTrainer(PrefixGroupTrainer, GRPOTrainer):
    """TRL's `GRPOTrainer` (same arguments) with what `PrefixGroupTrainer` adds."""


class PrefixRLOOTrainer(PrefixGroupTrainer, RLOOTrainer):
    """TRL's `RLOOTrainer` (same arguments) with what `PrefixGroupTrainer` adds."""
