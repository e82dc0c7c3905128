"""The Trainer events `PrefixDPOTrainer` acts on, through transformers' public callback hooks."""

from __future__ import annotations

import json
import math
import os

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from prefixdpo.errors import UserError

STATE_FILE = "prefixdpo_state.json"  # our per-checkpoint state (BCO's running mean), beside Trainer's


class NonFiniteLossError(UserError):
    """The loss became NaN/inf; training stopped before the optimizer step that would apply it."""


class PrefixDPOCallback(TrainerCallback):
    """Re-plans each epoch, keeps throughput free of set-up time, refuses a non-finite step before the
    optimizer applies it, and saves our state in every checkpoint."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._metrics["train"].reset()  # throughput excludes set-up

    def on_epoch_begin(self, args, state, control, **kwargs):
        # Re-plan this epoch's micro-batches (seeded by epoch) before Trainer iterates, or skips into them
        # on resume. `state.epoch` is a whole number at an epoch's start, and epoch + fraction on resume.
        micro = self.trainer._train_micro
        if micro is not None:
            micro.set_epoch(math.floor(state.epoch + 1e-9))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        flag = torch.tensor([float(trainer._nonfinite_loss is not None)], device=args.device)
        if trainer.accelerator.num_processes > 1:  # every rank decides together
            flag = trainer.accelerator.reduce(flag, reduction="sum")
        loss, trainer._nonfinite_loss = trainer._nonfinite_loss, None
        if flag.item() > 0:
            last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
            raise NonFiniteLossError(
                f"loss became {loss if loss is not None else 'NaN/inf on another rank'} (NaN/inf) in optimizer step "
                f"{state.global_step + 1}; stopped before applying it. Last good checkpoint: "
                f"{last or 'none saved yet'}. Try a lower learning rate, fp32/bf16 instead of fp16, or check the data."
            )

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if args.should_save and os.path.isdir(folder):
            with open(os.path.join(folder, STATE_FILE), "w", encoding="utf-8") as fh:
                json.dump(self.trainer.step_context.state_dict(), fh)


def load_state(checkpoint: str) -> dict:
    """Our state saved by `on_save` in `checkpoint` ({} for checkpoints written before it existed)."""
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)
