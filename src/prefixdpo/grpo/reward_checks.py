"""Reward functions that cannot end a GRPO/RLOO run silently wrong.

TRL 1.16 calls each reward function once per generation with the completions (and their prompts and the dataset's
other fields) as keyword arguments, and expects back one reward per completion: a number, or None where the
function does not apply (TRL turns None into NaN and takes NaN-ignoring means). Where that contract breaks, TRL
either reports a run that learned nothing as done (every reward None/NaN: advantages 0, loss 0, "Model saved") or
one that learned from an infinite reward, or ends in a traceback naming no step. Here:

- a reward function that raises, or returns anything but one number-or-None per completion, stops the run with
  `RewardFunctionError`: one line naming the function, the optimizer step, what it returned (or raised, and
  where) and the last complete checkpoint to resume from; exit 2, nothing saved after it. Every rank checks its
  own completions and the ranks agree before anyone raises, so a function failing on one rank stops all of them
  with the same line instead of leaving the others waiting in TRL's gather;
- a step whose rewards are unusable, every completion's reward None/NaN under every function, or any reward
  infinite (`unusable_rewards`), is a non-finite step: its loss is made NaN (`RewardGuard.poisoned`), so the
  non-finite guard (and DeepSpeed's own overflow check) treats it as it treats a NaN loss: `--nonfinite stop`
  names the function, the step and the last good checkpoint; `skip` skips the step and counts it;
- a None/NaN for *some* completions keeps TRL's meaning (those completions are left out of the means).
"""

from __future__ import annotations

import functools
import logging
import numbers
import os
import traceback

import torch
from torch import nn
from trl.trainer.utils import is_async_callable

from prefixdpo.errors import UserError
from prefixdpo.core.rank_decisions import any_rank, gather, rank_and_world
from prefixdpo.training import checkpoints

logger = logging.getLogger(__name__)

CONTRACT = "one reward per completion: a number, or None where the function does not apply"


class RewardFunctionError(UserError):
    """A reward function raised, or returned something other than one number-or-None per completion."""


def _shown(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def output_problem(output, expected: int) -> str | None:
    """Why `output` breaks TRL's reward contract for `expected` completions (None: it keeps it)."""
    if isinstance(output, (torch.Tensor,)) or type(output).__module__ == "numpy":
        if getattr(output, "ndim", 0) != 1:
            return f"returned {type(output).__name__} of shape {tuple(output.shape)}, not a list ({CONTRACT})"
        output = output.tolist()
    if not isinstance(output, (list, tuple)):
        return f"returned {_shown(output)} ({type(output).__name__}), not a list of {expected} rewards ({CONTRACT})"
    if len(output) != expected:
        return f"returned {len(output)} rewards for {expected} completions ({CONTRACT})"
    for i, value in enumerate(output):
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if number is not None and not isinstance(number, numbers.Real):
            return f"returned {_shown(value)} ({type(value).__name__}) for completion {i} ({CONTRACT})"
    return None


def _raised(err: BaseException) -> str:
    """'raised ValueError: bad input (rewards.py:12)': the exception and the innermost line it came from."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"raised {type(err).__name__}: {' '.join(str(err).split())}{where}"


def checked_reward(func, name: str, problems: list[str]):
    """`func` (a TRL reward function, plain or async) that records what it did wrong in `problems` instead of
    raising, and then returns placeholder zeros (never used: the run stops right after TRL's gather), so that TRL
    reaches its gather on every rank and the ranks can agree (`RewardGuard.check`)."""

    def outcome(output, err: Exception | None, kwargs: dict) -> list:
        expected = len(kwargs["prompts"])  # TRL passes everything by keyword
        problem = _raised(err) if err is not None else output_problem(output, expected)
        if problem is not None:
            problems.append(f"reward function {name!r} {problem}")
            return [0.0] * expected
        return output.tolist() if hasattr(output, "tolist") else list(output)

    if is_async_callable(func):  # TRL's test: async functions, partials of them, classes with an async __call__
        @functools.wraps(func)
        async def async_checked(**kwargs):
            try:
                output = await func(**kwargs)
            except Exception as err:  # the user's code: any exception is its fault, reported in one line
                return outcome(None, err, kwargs)
            return outcome(output, None, kwargs)

        return async_checked

    @functools.wraps(func)
    def checked(**kwargs):
        try:
            output = func(**kwargs)
        except Exception as err:  # the user's code: any exception is its fault, reported in one line
            return outcome(None, err, kwargs)
        return outcome(output, None, kwargs)

    return checked


def unusable_rewards(rewards: torch.Tensor, names: list[str]) -> str | None:
    """Why the step's rewards `rewards` [completions, functions] (every rank's, as TRL gathers them) give nothing
    to learn from, or a wrong signal: an infinite reward, or no reward at all (None/NaN everywhere); None if they
    are usable."""
    n = rewards.shape[0]
    infinite = torch.isinf(rewards)
    if infinite.any():
        f = int(infinite.any(dim=0).int().argmax())
        count, value = int(infinite[:, f].sum()), float(rewards[infinite[:, f], f][0])
        return f"reward function {names[f]!r} returned {value} for {count} of {n} completions"
    if n and torch.isnan(rewards).all():
        which = (f"reward function {names[0]!r}" if len(names) == 1
                 else f"every reward function ({', '.join(map(repr, names))})")
        return f"{which} returned None or NaN for all {n} completions: no reward to learn from"
    return None


class RewardGuard:
    """The reward checks of the module docstring, one per run, called by a group trainer's overrides of TRL's
    `_calculate_rewards` (`check`) and `compute_loss` (`poisoned`). `guarded` wraps the reward functions once, after
    TRL's `__init__`."""

    def __init__(self):
        self.problems: list[str] = []  # what the functions did wrong in the current call (`checked_reward`)
        self.fault: str | None = None  # why the current generation's rewards are unusable (training)

    def guarded(self, reward_funcs: list, names: list) -> list:
        """`reward_funcs` with each function (not a reward model) recording its problems here (`checked_reward`)."""
        return [func if isinstance(func, nn.Module) else checked_reward(func, name, self.problems)
                for func, name in zip(reward_funcs, names)]

    def begin(self) -> None:
        """Before TRL's `_calculate_rewards`: no problem recorded yet."""
        self.problems.clear()

    def check(self, rewards: torch.Tensor, names: list, *, device, training: bool, step: int, output_dir: str,
              run_fingerprint) -> torch.Tensor:
        """`rewards` [completions, functions] of TRL's `_calculate_rewards`, after the checks: a problem on any rank
        stops the run in one line (`RewardFunctionError`); unusable rewards make this training step's loss NaN
        (`poisoned`), or are said in evaluation. step: the optimizer steps done; output_dir and run_fingerprint: where
        the last complete checkpoint of the run is looked for."""
        where = f"optimizer step {step + 1}" if training else f"evaluation after optimizer step {step}"
        if any_rank(bool(self.problems), device):
            self._raise_problem(where, output_dir, run_fingerprint)
        fault = unusable_rewards(rewards, [str(n) for n in names])
        if training:
            self.fault = fault
        elif fault is not None:  # evaluation applies nothing: its metrics say what the rewards were
            logger.warning("%s: %s", where, fault)
        return rewards

    def _raise_problem(self, where: str, output_dir: str, run_fingerprint) -> None:
        """Every rank raises the same one line: the first problem of the first rank that had one."""
        _, world = rank_and_world()
        for rank, problems in enumerate(gather(list(self.problems))):
            if problems:
                on = f" on rank {rank}" if world > 1 else ""
                last = checkpoints.last_good_checkpoint(output_dir, run_fingerprint)
                resume = (f"the last complete checkpoint is {last}: fix the function and resume with "
                          "--resume_from_checkpoint latest" if last else "no checkpoint was saved before it")
                raise RewardFunctionError(f"{where}: {problems[0]}{on}; stopped, {resume}")

    def poisoned(self, loss, model, return_outputs: bool, nonfinite):
        """TRL's `loss`, made NaN in a training step on unusable rewards (its reason noted by the `nonfinite` guard)."""
        if self.fault is None or return_outputs or not model.training:
            return loss
        # a step on unusable rewards is a non-finite step: a NaN loss reaches every gradient, which the guard (and
        # DeepSpeed's overflow check) stops or skips; the guard names the reason
        nonfinite.note_cause(self.fault)
        return loss * float("nan")


__all__ = ["RewardGuard", "RewardFunctionError", "checked_reward", "output_problem", "unusable_rewards"]
