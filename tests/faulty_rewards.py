"""Reward functions that break TRL's contract on purpose, for tests/test_grpo_reward_faults.py (`--reward_funcs
faulty_rewards:NAME`). The `_at_3` ones are well-behaved except while optimizer step 3 generates (TRL passes its
`trainer_state`: global_step counts the finished steps)."""

from __future__ import annotations

import os

from grpo_common import reward_vowels


def _at_step_3(trainer_state) -> bool:
    return trainer_state.global_step == 2


def all_none_at_3(completions, trainer_state, **kwargs):
    return [None] * len(completions) if _at_step_3(trainer_state) else reward_vowels(completions)


def all_nan_at_3(completions, trainer_state, **kwargs):
    return [float("nan")] * len(completions) if _at_step_3(trainer_state) else reward_vowels(completions)


def one_inf_at_3(completions, trainer_state, **kwargs):
    rewards = reward_vowels(completions)
    return [float("inf")] + rewards[1:] if _at_step_3(trainer_state) else rewards


def some_none(completions, **kwargs):
    """None for every other completion: TRL leaves those out of its means (a function that applies to some)."""
    return [None if i % 2 else r for i, r in enumerate(reward_vowels(completions))]


def returns_none(completions, **kwargs):
    return None


def raises(completions, **kwargs):
    raise ZeroDivisionError("no completions to divide by")


def raises_on_rank_1(completions, **kwargs):
    if os.environ.get("RANK") == "1":
        raise KeyError("answer")
    return reward_vowels(completions)
