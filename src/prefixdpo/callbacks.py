"""The Trainer events `PrefixDPOTrainer` acts on, through transformers' public callback hooks, and the
TR-DPO reference update (`tr_dpo_callback`)."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from prefixdpo.atomic_io import atomic_write_json
from prefixdpo.engines import describe_engine
from prefixdpo.errors import ConfigError, UserError
from prefixdpo.nonfinite import NonFiniteLossError  # noqa: F401  (raised through here; imported from here by users)
from prefixdpo.reference import NoReference, SeparateModelReference, is_peft_model

logger = logging.getLogger(__name__)

STATE_FILE = "prefixdpo_state.json"  # our per-checkpoint state (BCO's running mean), beside Trainer's


class PrefixDPOCallback(TrainerCallback):
    """Re-plans each epoch, keeps throughput free of set-up time, has every optimizer step checked for
    non-finite values before the optimizer applies it (`nonfinite.NonFiniteGuard`), and saves our state in
    every checkpoint."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.trainer._metrics["train"].reset()  # throughput excludes set-up
        # the model is prepared by now: say which engine runs it (and that FSDP really sharded it)
        self.trainer.engine_description = describe_engine(self.trainer.accelerator, model or self.trainer.model)
        logger.info("engine: %s", self.trainer.engine_description)
        self.trainer.nonfinite.attach(self.trainer)  # nonfinite=skip: the prepared optimizer can skip a step

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
                                     functools.partial(last_good_checkpoint, args.output_dir))

    def nonfinite_state(self) -> dict:
        """The non-finite guard's counts (skipped steps, consecutive non-finite steps), saved per checkpoint."""
        return self.trainer.nonfinite.state_dict()

    def load_nonfinite_state(self, state: dict) -> None:
        self.trainer.nonfinite.load_state_dict(state)

    def checkpoint_state(self) -> dict:
        """What `on_save` writes beside Trainer's files: the step context's state and the non-finite counts."""
        return {**self.trainer.step_context.state_dict(), "nonfinite": self.nonfinite_state()}

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if args.should_save and os.path.isdir(folder):
            atomic_write_json(os.path.join(folder, STATE_FILE), self.checkpoint_state())


_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def last_good_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` folder in `output_dir` whose model weights are all finite, or None.

    Weights are the safetensors files of the folder (`model.safetensors`, the shards a
    `model.safetensors.index.json` names, `adapter_model.safetensors`), read one tensor at a time. A folder
    with no safetensors weights (a DeepSpeed or FSDP sharded state) is taken as it is.
    """
    if not os.path.isdir(output_dir):
        return None
    numbered = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    for _, name in sorted(numbered, reverse=True):
        folder = os.path.join(output_dir, name)
        if os.path.isdir(folder) and _weights_finite(folder):
            return folder
    return None


def _weights_finite(folder: str) -> bool:
    """Whether every tensor in the folder's safetensors weight files is finite (True when there are none)."""
    from safetensors import safe_open

    files = {name for name in os.listdir(folder) if name.endswith(".safetensors")}
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            files |= set(json.load(fh).get("weight_map", {}).values())
    for name in sorted(files):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return False  # a shard the index names is missing: not a checkpoint to resume from
        try:
            with safe_open(path, framework="pt") as fh:
                for key in fh.keys():
                    tensor = fh.get_tensor(key)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        return False
        except Exception:  # noqa: BLE001  (a truncated or garbled file: whatever safetensors raises, not good)
            return False
    return True


def latest_checkpoint(output_dir: str) -> str:
    """The newest `checkpoint-*` folder in `output_dir` (`resume_from_checkpoint="latest"`)."""
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if last is None:
        raise UserError(f"resume_from_checkpoint='latest': no checkpoint-* folder in {output_dir}")
    return last


def load_state(checkpoint: str) -> dict:
    """Our state saved by `on_save` in `checkpoint` ({} for checkpoints written before it existed)."""
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


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
