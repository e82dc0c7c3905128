"""The Trainer events every prefixdpo trainer acts on, through transformers' public callback hooks: epoch
re-planning, throughput without set-up time, the non-finite guard, and preemption (`RunCallback`)."""

from __future__ import annotations

import functools
import logging
import math
import signal
import threading

from transformers import TrainerCallback

from prefixdpo.training.checkpoints import last_good_checkpoint
from prefixdpo.core.engines import describe_engine
from prefixdpo.rank_decisions import any_rank

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what schedulers send before killing a job


class PreemptionSignals:
    """SIGTERM / SIGUSR1 during training: remembered by the handler, acted on at the end of the optimizer step
    (`RunCallback.on_step_end`). Handlers can only be installed from the main thread."""

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


class RunCallback(TrainerCallback):
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
