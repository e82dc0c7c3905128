"""The Trainer events every prefixdpo preference/reward trainer acts on, through transformers' public callback
hooks: epoch re-planning and throughput without set-up time (`RunCallback`); the preemption signals that
`survival.SurvivalCallback` (the non-finite guard and preemption, shared with the GRPO/RLOO trainers) acts on."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time

from transformers import TrainerCallback

from prefixdpo.core.engines import describe_engine

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what schedulers send before killing a job
# Under torchrun a terminal's Ctrl-C reaches each worker twice within milliseconds: from the terminal (one process
# group) and forwarded by torchrun's agent. A SIGINT that soon after the first is the same key press.
SAME_CTRL_C_S = 2.0


def _say(text: str) -> None:
    """One line on stderr from a signal handler: os.write, since a buffered stream the interrupted code was
    writing to raises on a reentrant write; said by the first process only."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, (text + "\n").encode())


class PreemptionSignals:
    """SIGTERM / SIGUSR1 / a first Ctrl-C (SIGINT) during training: remembered by the handler, acted on at the end
    of the optimizer step (`survival.SurvivalCallback.on_step_end`: a complete checkpoint, then a stop), or during
    an evaluation inside training at its next batch (the evaluation stops, the last completed step is saved). A second
    Ctrl-C stops at once (KeyboardInterrupt): a checkpoint being written then stays in its hidden staging folder,
    never in view. Handlers can only be installed from the main thread."""

    def __init__(self):
        self.received: int | None = None
        self._first_interrupt: float | None = None
        self._previous: dict = {}
        self.evaluating = False  # set around an evaluation inside training: the signal then stops the evaluation

    def install(self) -> None:
        self.received, self._first_interrupt = None, None
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in PREEMPTION_SIGNALS}
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def _interrupt(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first_interrupt is None:
            self._first_interrupt = now
            self.received = signum
            if self.evaluating:
                _say("prefixdpo: Ctrl-C: stopping the evaluation, then saving a checkpoint of the last completed "
                     "optimizer step (Ctrl-C again to stop at once)")
            else:
                _say("prefixdpo: Ctrl-C: finishing this optimizer step, then saving a checkpoint "
                     "(Ctrl-C again to stop at once, losing the step)")
            return
        if os.environ.get("TORCHELASTIC_RUN_ID") and now - self._first_interrupt < SAME_CTRL_C_S:
            return  # torchrun forwarding the same Ctrl-C
        self.restore()
        raise KeyboardInterrupt

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
        sp = self.trainer.sharing.sequence_parallel
        if sp is not None:
            groups = self.trainer.accelerator.num_processes // sp.size
            self.trainer.engine_description += f"; sequence parallel: {groups} group(s) of {sp.size} ranks per line"
        logger.info("engine: %s", self.trainer.engine_description)

    def on_epoch_begin(self, args, state, control, **kwargs):
        # Re-plan this epoch's micro-batches (seeded by epoch) before Trainer iterates, or skips into them
        # on resume. `state.epoch` is a whole number at an epoch's start, and epoch + fraction on resume.
        micro = self.trainer._train_micro
        if micro is not None:
            micro.set_epoch(math.floor(state.epoch + 1e-9))
