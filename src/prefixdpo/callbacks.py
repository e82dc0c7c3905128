"""The Trainer events prefixdpo's trainers act on, through transformers' public callback hooks, and the
TR-DPO reference update (`tr_dpo_callback`)."""

from __future__ import annotations

import functools
import logging
import math
import signal
import threading

import torch
from transformers import TrainerCallback

from prefixdpo.checkpoints import last_good_checkpoint
from prefixdpo.engines import describe_engine
from prefixdpo.rank_decisions import any_rank
from prefixdpo.errors import ConfigError, UserError
from prefixdpo.nonfinite import NonFiniteLossError  # noqa: F401  (raised through here; imported from here by users)
from prefixdpo.reference import NoReference, SeparateModelReference, is_peft_model

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what schedulers send before killing a job


class PreemptionSignals:
    """SIGTERM / SIGUSR1 during training: remembered by the handler, acted on at the end of the optimizer step
    (`PrefixDPOCallback.on_step_end`). Handlers can only be installed from the main thread."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def install(self) -> None:
        self.received = None
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in PREEMPTION_SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class PrefixDPOCallback(TrainerCallback):
    """Re-plans each epoch, keeps throughput free of set-up time, has every optimizer step checked for
    non-finite values before the optimizer applies it (`nonfinite.NonFiniteGuard`), and turns a preemption
    signal into a checkpoint and a stop after the optimizer step."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.signals = PreemptionSignals()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.trainer._metrics["train"].reset()  # throughput excludes set-up
        # the model is prepared by now: say which engine runs it (and that FSDP really sharded it)
        self.trainer.engine_description = describe_engine(self.trainer.accelerator, model or self.trainer.model)
        logger.info("engine: %s", self.trainer.engine_description)
        self.trainer.nonfinite.attach(self.trainer)  # nonfinite=skip: the prepared optimizer can skip a step
        self.signals.install()

    def on_step_end(self, args, state, control, **kwargs):
        # every rank stops after the same step, whichever ranks the signal reached
        if self.trainer.preempted_at is None and any_rank(self.signals.received is not None, args.device):
            self.trainer.preempted_at = state.global_step
            control.should_save = True  # Trainer saves (a complete checkpoint) right after this hook
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        # a signal after the last step's check still means "stop, not done": `train` saves and raises
        if self.trainer.preempted_at is None and any_rank(self.signals.received is not None, args.device):
            self.trainer.preempted_at = state.global_step
        self.signals.restore()  # from here a SIGTERM ends the process as usual (nothing exported yet)

    def on_epoch_begin(self, args, state, control, **kwargs):
        # Re-plan this epoch's micro-batches (seeded by epoch) before Trainer iterates, or skips into them
        # on resume. `state.epoch` is a whole number at an epoch's start, and epoch + fraction on resume.
        micro = self.trainer._train_micro
        if micro is not None:
            micro.set_epoch(math.floor(state.epoch + 1e-9))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # The narrowest public hook that sees a whole step before it is applied: Trainer calls it once per
        # optimizer step, after every micro-batch's backward and the gradient sync, clipping and norm, and
        # right before `optimizer.step()` (DeepSpeed: after its engine step, which skips non-finite steps).
        self.trainer.nonfinite.check(self.trainer, model or self.trainer.model, state.global_step + 1,
                                     functools.partial(last_good_checkpoint, args.output_dir,
                                                       self.trainer.run_fingerprint))


class SyncReferenceCallback(TrainerCallback):
    """TR-DPO (`sync_ref_model`), as TRL 1.16's `SyncRefModelCallback`: at the end of every optimizer step
    whose number is a multiple of `ref_model_sync_steps`, the reference becomes
    ``ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * reference``. Both options are read
    from `args` at each step, as TRL does."""

    def __init__(self, reference: SeparateModelReference):
        self.reference = reference

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.reference.mix_in(model, args.ref_model_mixup_alpha)


def tr_dpo_callback(args, reference, policy) -> SyncReferenceCallback | None:
    """The TR-DPO callback for `reference` if `args.sync_ref_model`, else None.

    Refused with a one-line ConfigError where TRL 1.16's `DPOTrainer` refuses: a PEFT policy (its
    reference is the adapter switched off; there is no separate model to update) and precomputed
    reference log-probs (they would go stale). Ignored, with a warning, for losses that use no reference
    (TRL's callback does nothing without a reference model). Also refused: `ref_model_sync_steps` below 1
    (TRL fails on it at the first step) and `ref_model_mixup_alpha` outside [0, 1] (TR-DPO's range), and
    a given `ref_model` whose parameters are not the policy's. `PrefixDPOConfig` checks the options when
    built; they are checked again here because Trainer's args can be changed after that (TRL too checks
    them when the trainer is built).
    """
    if not args.sync_ref_model:
        return None
    if is_peft_model(policy):
        raise ConfigError(
            "sync_ref_model=True is not supported with a PEFT model (as in TRL 1.16): the reference is the base "
            "model with the adapter off, so there is no separate reference model to update"
        )
    if args.precompute_ref_log_probs:
        raise ConfigError(
            "sync_ref_model=True cannot be combined with precompute_ref_log_probs=True: the reference changes "
            "during training, so precomputed reference log-probs would go stale; set one of them to False"
        )
    if isinstance(reference, NoReference):
        logger.warning("sync_ref_model=True has no effect: loss_type %s uses no reference model", args.loss_type)
        return None
    steps = args.ref_model_sync_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"ref_model_sync_steps={steps!r}: expected a positive integer (optimizer steps)")
    alpha = args.ref_model_mixup_alpha
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"ref_model_mixup_alpha={alpha!r}: expected a number in [0, 1]")
    reference.check_mixable(policy)
    return SyncReferenceCallback(reference)
