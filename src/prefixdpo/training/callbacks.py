"""The Trainer events every prefixdpo preference/reward trainer acts on, through transformers' public callback
hooks: epoch re-planning and throughput without set-up time (`RunCallback`); the preemption signals that
`survival.SurvivalCallback` (the non-finite guard and preemption, shared with the GRPO/RLOO trainers) acts on."""

from __future__ import annotations

import logging
import math
import signal
import threading

from transformers import TrainerCallback

from prefixdpo.core.engines import describe_engine

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what schedulers send before killing a job


class PreemptionSignals:
    """SIGTERM / SIGUSR1 during training: remembered by the handler, acted on at the end of the optimizer step
    (`survival.SurvivalCallback.on_step_end`). Handlers can only be installed from the main thread."""

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
    """Re-plans each epoch and keeps throughput free of set-up time."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.trainer._metrics["train"].reset()  # throughput excludes set-up
        # the model is prepared by now: say which engine runs it (and that FSDP really sharded it)
        self.trainer.engine_description = describe_engine(self.trainer.accelerator, model or self.trainer.model)
        logger.info("engine: %s", self.trainer.engine_description)

    def on_epoch_begin(self, args, state, control, **kwargs):
        # Re-plan this epoch's micro-batches (seeded by epoch) before Trainer iterates, or skips into them
        # on resume. `state.epoch` is a whole number at an epoch's start, and epoch + fraction on resume.
        micro = self.trainer._train_micro
        if micro is not None:
            micro.set_epoch(math.floor(state.epoch + 1e-9))
