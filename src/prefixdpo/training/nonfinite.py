"""A step is applied only if it is finite everywhere: the loss of every micro-batch and the gradient norm,
agreed by every rank (`nonfinite`: `stop` or `skip`).

transformers 5.24's `Trainer._run_epoch` runs, per optimizer step: the backward of every micro-batch ->
clip / gradient norm (`_get_grad_norm`) -> `on_pre_optimizer_step` -> `optimizer.step()` -> the lr scheduler
unless `accelerator.optimizer_step_was_skipped` -> `zero_grad`. Where the verdict is carried out:

- one process, DDP, FSDP2: `on_pre_optimizer_step` (the public hook, called once per step when the
  gradients are complete, synced and clipped and nothing is applied yet) takes the verdict. `stop` raises
  there. `skip` turns the coming `optimizer.step()` into a no-op that accelerate reports as skipped, as it
  reports a step fp16's GradScaler skipped, so Trainer leaves the lr scheduler alone too (`StepSkipper`).
- DeepSpeed: accelerate runs `engine.step()` inside `accelerator.backward` of the last micro-batch, before
  that hook. DeepSpeed ZeRO itself skips a step whose gradients hold NaN/inf, before touching weights,
  optimizer state or lr scheduler (the configs `deepspeed_gap` accepts); a non-finite micro-batch loss is
  made to reach the gradients (`poisoned`) so that check sees it too. The verdict then stops the run
  after a step DeepSpeed did not apply, or counts it; a non-finite step DeepSpeed applied anyway is an error.
- fp16 with a loss scaler (torch's GradScaler, DeepSpeed's): gradient overflow is the scaler's business
  (it skips the step and lowers the scale, many times early in a healthy run); only the loss is checked.

The verdict is one `gather` of every rank's flags (non-finite loss, non-finite gradients, the loss value),
so every rank takes the same decision and no rank steps alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from prefixdpo.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

POLICIES = ("stop", "skip")
NONFINITE_HELP = (
    "An optimizer step whose loss (any micro-batch, any rank) or gradient norm is NaN/inf: stop (default: raise "
    "before the optimizer applies it, naming the step and the last checkpoint with finite weights) or skip (as "
    "fp16 loss scaling skips overflow steps: no weight, optimizer-state or lr-scheduler change; the count is "
    "logged as nonfinite_skipped; stops after nonfinite_max_consecutive such steps in a row)."
)
# 10: one bad batch, or a short burst, is skipped; ten steps in a row means the run itself is broken (the
# weights or the data stream), and stopping then wastes ten steps of compute, not the rest of the run.
NONFINITE_MAX_CONSECUTIVE_HELP = "nonfinite=skip: stop when this many optimizer steps in a row are non-finite."


class NonFiniteLossError(UserError):
    """A step's loss or gradient norm was NaN/inf (or, with `nonfinite=skip`, too many steps in a row):
    training stopped before the optimizer applied it."""


def check_nonfinite_options(policy: str, max_consecutive: int) -> None:
    """ConfigError (one line) for a bad `nonfinite` / `nonfinite_max_consecutive`."""
    if policy not in POLICIES:
        raise ConfigError(f"nonfinite={policy!r}: choose one of {', '.join(POLICIES)}")
    if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 1:
        raise ConfigError(f"nonfinite_max_consecutive={max_consecutive!r}: expected a positive integer")


def poisoned(loss: torch.Tensor) -> torch.Tensor:
    """`loss` ([] or any shape), multiplied by 1 where it is finite (exactly the same value and gradient)
    and by NaN where it is not: every gradient the loss reaches is then NaN, which DeepSpeed's own overflow
    check (and DDP's averaging, to every rank) carries. No device sync."""
    keep = torch.isfinite(loss.detach())
    return loss * torch.where(keep, torch.ones_like(loss), torch.full_like(loss, float("nan")))


def _enabled(block: dict | None, trainer_flag: bool) -> bool:
    """A DeepSpeed `{"enabled": true|false|"auto"}` precision block; "auto" follows the training argument."""
    value = (block or {}).get("enabled", False)
    return bool(trainer_flag) if value == "auto" else bool(value)


def deepspeed_gap(ds_config: dict, args) -> str | None:
    """Why DeepSpeed (0.19) would apply a step whose gradients are NaN/inf with this config; None where it
    skips such a step itself (the ZeRO optimizers' overflow / invalid-norm check)."""
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    fp16 = _enabled(ds_config.get("fp16"), args.fp16)
    bf16 = _enabled(ds_config.get("bf16") or ds_config.get("bfloat16"), args.bf16)
    if fp16 or stage == 3:  # the loss scaler's overflow check; ZeRO-3 refuses any invalid gradient norm
        return None
    if bf16:  # BF16_Optimizer (stage 0) always checks; ZeRO-1/2 only with bf16.check_grad_overflow
        if stage == 0 or (ds_config.get("bf16") or {}).get("check_grad_overflow", True) is not False:
            return None
        return "bf16.check_grad_overflow is false: DeepSpeed then applies a step whose gradients are NaN/inf"
    if stage == 0:
        return "DeepSpeed without ZeRO in fp32 applies a step whose gradients are NaN/inf"
    if (ds_config.get("zero_optimization") or {}).get("compute_grad_norm", True) is False:
        return "zero_optimization.compute_grad_norm is false: DeepSpeed then never checks the gradients"
    return None


def uses_loss_scaling(trainer) -> bool:
    """fp16 with a loss scaler: torch's GradScaler (accelerate) or DeepSpeed's."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        return _enabled(plugin.deepspeed_config.get("fp16"), trainer.args.fp16)
    return getattr(trainer.accelerator, "scaler", None) is not None


def check_engine_support(trainer, policy: str) -> None:
    """When the trainer is built: refuse (one line) an engine under which `policy` (the run's `nonfinite`) cannot
    hold."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        gap = deepspeed_gap(plugin.deepspeed_config, trainer.args)
        if gap is not None:
            raise ConfigError(f"nonfinite={policy}: {gap}; use ZeRO stage 1-3 with DeepSpeed's overflow "
                              "check on (its default), or DDP/FSDP")
    if policy == "skip" and uses_loss_scaling(trainer):
        raise ConfigError("nonfinite=skip with fp16: fp16's loss scaler already skips steps whose gradients "
                          "overflow; use nonfinite=stop (stops on a non-finite loss), or bf16/fp32 with skip")


class StepSkipper:
    """Makes the optimizer step Trainer calls a no-op on the steps the guard skips: no weight, optimizer
    state (AdamW moments, step count) or lr-scheduler change.

    `accelerated` is accelerate's `AcceleratedOptimizer`; the torch optimizer inside it is the one whose
    `step` is skipped (the wrapper the lr scheduler put on the outer `step` stays as it is). accelerate's
    `step_was_skipped` (`_is_overflow`, what it sets when fp16's GradScaler skips a step) then tells Trainer
    not to step the lr scheduler; Trainer's `zero_grad` drops the gradients.
    """

    def __init__(self, accelerated):
        if not hasattr(accelerated, "_is_overflow"):  # accelerate changed: the scheduler would step regardless
            raise RuntimeError(f"{type(accelerated).__name__} has no `_is_overflow`: cannot skip a step exactly")
        self.accelerated = accelerated
        self.original_step = accelerated.optimizer.step
        self.skip_next = False
        accelerated.optimizer.step = self.step

    def step(self, *args, **kwargs):
        skip, self.skip_next = self.skip_next, False
        self.accelerated._is_overflow = skip
        if not skip:
            return self.original_step(*args, **kwargs)
        return None


class NonFiniteGuard:
    """The per-step check and the run's counts (saved in every checkpoint: `state_dict`).

    Trainer feeds it each micro-batch's loss (`note_loss`, no device sync) and the step's gradient norm
    (`note_grad_norm`); `check` then gathers the flags of every rank once per optimizer step.
    """

    def __init__(self, policy: str, max_consecutive: int):
        check_nonfinite_options(policy, max_consecutive)
        self.policy = policy
        self.max_consecutive = max_consecutive
        self.skipped = 0  # steps skipped in the whole run
        self.consecutive = 0  # non-finite steps in a row, up to the last one
        self.skipper: StepSkipper | None = None
        self._losses: list[torch.Tensor] = []
        self._grad_norm = None
        self._cause: str | None = None  # why this step's loss was made NaN (a GRPO step on unusable rewards)

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.consecutive = int(state.get("consecutive", 0))

    # ---- what one step saw --------------------------------------------------------------------

    def note_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach().float().reshape(-1))

    def note_grad_norm(self, grad_norm) -> None:
        self._grad_norm = grad_norm

    def note_cause(self, cause: str) -> None:
        """Why a micro-batch's loss of this step was made NaN on purpose (said instead of "the loss was nan"; the
        same on every rank: the rewards it comes from were gathered)."""
        self._cause = cause

    def attach(self, trainer) -> None:
        """At train start (the optimizer is prepared): the skipper where the guard itself skips steps."""
        self._losses, self._grad_norm, self._cause = [], None, None  # nothing left over from a run that raised
        deepspeed = getattr(trainer.accelerator.state, "deepspeed_plugin", None) is not None
        if self.policy == "skip" and not deepspeed:
            if self.skipper is None or self.skipper.accelerated is not trainer.optimizer:
                self.skipper = StepSkipper(trainer.optimizer)

    def _local_flags(self, trainer, model) -> torch.Tensor:
        """[1, 3] on the device: (a micro-batch loss was non-finite, the gradients are non-finite, the first
        such loss, else 0). Built without a device sync: the one sync of the check is after the gather."""
        device = trainer.accelerator.device
        losses = torch.cat(self._losses).to(device) if self._losses else torch.zeros(1, device=device)
        bad = ~torch.isfinite(losses)
        first = torch.where(bad.any(), losses[bad.int().argmax()], torch.zeros((), device=device))
        grads = torch.as_tensor(self._gradients_bad(trainer, model), device=device)
        return torch.stack([bad.any().float(), grads.float().reshape(()), first]).reshape(1, 3)

    def _gradients_bad(self, trainer, model) -> bool | torch.Tensor:
        if uses_loss_scaling(trainer):
            return False  # the scaler skips overflowing steps itself (module docstring)
        if getattr(trainer.accelerator.state, "deepspeed_plugin", None) is not None:
            return bool(trainer.accelerator.optimizer_step_was_skipped)  # DeepSpeed's own overflow verdict
        norm = self._grad_norm
        if norm is None:  # a Trainer that no longer reports its norm: every local gradient entry instead
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            return ~torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else False
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return ~torch.isfinite(torch.as_tensor(norm))

    # ---- the verdict --------------------------------------------------------------------------

    def check(self, trainer, model, step: int, last_good: Callable[[], str | None]) -> None:
        """Once per optimizer step on every rank, before `optimizer.step()`: nothing (apply), a skip (the
        skipper or DeepSpeed drops the step), or NonFiniteLossError. `last_good` names the checkpoint to
        resume from, asked only when raising."""
        flags = self._local_flags(trainer, model)
        cause, self._losses, self._grad_norm, self._cause = self._cause, [], None, None
        if trainer.accelerator.num_processes > 1:  # one collective: every rank sees every rank's flags
            flags = trainer.accelerator.gather(flags)
        flags = flags.cpu().tolist()
        loss_ranks = [rank for rank, row in enumerate(flags) if row[0]]
        if not loss_ranks and not any(row[1] for row in flags):
            self.consecutive = 0
            return
        what = cause or self._describe(flags, loss_ranks, trainer.accelerator.num_processes)
        advice = ("Fix the reward function, or use nonfinite=skip to skip such steps" if cause else
                  "Try a lower learning rate, bf16/fp32 instead of fp16, check the data, or nonfinite=skip")
        deepspeed = getattr(trainer.accelerator.state, "deepspeed_plugin", None) is not None
        if deepspeed and not trainer.accelerator.optimizer_step_was_skipped:
            raise NonFiniteLossError(f"optimizer step {step}: {what}, and DeepSpeed applied it; resume from the "
                                     f"last good checkpoint: {last_good() or 'none saved yet'}")
        self.consecutive += 1
        if self.policy == "stop":
            raise NonFiniteLossError(f"optimizer step {step}: {what}; stopped before applying it (nonfinite=stop). "
                                     f"Last good checkpoint: {last_good() or 'none saved yet'}. {advice}")
        self.skipped += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(
                f"optimizer step {step}: {self.consecutive} consecutive optimizer steps were non-finite (the last: "
                f"{what}), none applied; stopped (nonfinite_max_consecutive={self.max_consecutive}). Last good "
                f"checkpoint: {last_good() or 'none saved yet'}. Try a lower learning rate or check the data")
        if self.skipper is not None:
            self.skipper.skip_next = True
        logger.warning("optimizer step %d skipped: %s (%d skipped so far)", step, what, self.skipped)

    @staticmethod
    def _describe(flags: list[list[float]], loss_ranks: list[int], world: int) -> str:
        """'the loss was nan on rank 1, the gradient norm not finite' (ranks named when there are several)."""
        parts = []
        if loss_ranks:
            value = flags[loss_ranks[0]][2]
            ranks = f"rank{'s' if len(loss_ranks) > 1 else ''} {', '.join(map(str, loss_ranks))}"
            where = f" on {ranks}" if world > 1 else ""
            parts.append(f"the loss of a micro-batch was {value}{where}")
        if any(row[1] for row in flags):
            parts.append("the gradient norm was not finite")
        return " and ".join(parts)


__all__ = ["NonFiniteGuard", "NonFiniteLossError", "POLICIES", "StepSkipper", "check_engine_support",
           "check_nonfinite_options", "deepspeed_gap", "poisoned", "uses_loss_scaling"]
