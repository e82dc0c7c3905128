"""TR-DPO (`sync_ref_model`, https://huggingface.co/papers/2404.09656): the reference moves towards the policy
every `ref_model_sync_steps` optimizer steps, as TRL 1.16's `SyncRefModelCallback`."""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from prefixdpo.errors import ConfigError
from prefixdpo.training.model_setup import is_peft_model

logger = logging.getLogger(__name__)


class SyncReferenceCallback(TrainerCallback):
    """TR-DPO (`sync_ref_model`), as TRL 1.16's `SyncRefModelCallback`: at the end of every optimizer step
    whose number is a multiple of `ref_model_sync_steps`, the reference becomes
    ``ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * reference``. Both options are read
    from `args` at each step, as TRL does.

    reference: what `Reference.sync_target` returned (a strategy with `mix_in(policy, alpha)`)."""

    def __init__(self, reference):
        self.reference = reference

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.reference.mix_in(model, args.ref_model_mixup_alpha)


def check_tr_dpo_options(args) -> None:
    """Refuse (one line) bad TR-DPO options: `ref_model_sync_steps` below 1 (TRL fails on it at the first step),
    `ref_model_mixup_alpha` outside [0, 1] (TR-DPO's range), and `sync_ref_model` with precomputed reference
    log-probs (they would go stale; TRL 1.16 refuses it too). Run when the config is built and again when the
    trainer is (Trainer's args can be changed in between; TRL too checks them at the trainer)."""
    if args.sync_ref_model and args.precompute_ref_log_probs:
        raise ConfigError(
            "sync_ref_model=True cannot be combined with precompute_ref_log_probs=True: the reference changes "
            "during training, so precomputed reference log-probs would go stale; set one of them to False"
        )
    steps = args.ref_model_sync_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"ref_model_sync_steps={steps!r}: expected a positive integer (optimizer steps)")
    alpha = args.ref_model_mixup_alpha
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"ref_model_mixup_alpha={alpha!r}: expected a number in [0, 1]")


def tr_dpo_callback(args, reference, policy) -> SyncReferenceCallback | None:
    """The TR-DPO callback for `reference` (a `reference.Reference`) if `args.sync_ref_model`, else None.
    Called by `reference.build_reference`.

    Refused with a one-line ConfigError where TRL 1.16's `DPOTrainer` refuses: a PEFT policy (its
    reference is the adapter switched off; there is no separate model to update), bad options
    (`check_tr_dpo_options`), and a given `ref_model` whose parameters are not the policy's. Ignored, with a
    warning, for losses that use no reference (TRL's callback does nothing without a reference model).
    """
    if not args.sync_ref_model:
        return None
    if is_peft_model(policy):
        raise ConfigError(
            "sync_ref_model=True is not supported with a PEFT model (as in TRL 1.16): the reference is the base "
            "model with the adapter off, so there is no separate reference model to update"
        )
    check_tr_dpo_options(args)
    target = reference.sync_target()  # the strategy that moves; None without a reference; refused if none can
    if target is None:
        logger.warning("sync_ref_model=True has no effect: loss_type %s uses no reference model", args.loss_type)
        return None
    target.check_mixable(policy)
    return SyncReferenceCallback(target)
