"""`--reward_funcs` names -> reward callables, as TRL 1.16's `trl grpo` script resolves them, plus `module:function`.

- TRL's registered names (its script's registry): `accuracy_reward`, `reasoning_accuracy_reward`,
  `think_format_reward`, and `get_soft_overlong_punishment` built with TRL's script values
  (max_completion_len=1280, soft_punish_cache=256);
- `module:function` or `module.function`: a function of an importable module (the current folder is searched
  first, as TRL's script does), called as TRL calls reward functions (`prompts`, `completions`, the dataset's
  other fields, ... as keyword arguments; a list of floats back);
- a reward model: a folder holding a saved model (its `config.json`) or a hub id `org/name`, handed to TRL as its
  name (TRL loads it as a sequence classifier with `num_labels=1`, as `--reward_model_name_or_path`).
"""

from __future__ import annotations

import importlib
import os
import sys

from prefixdpo.grpo.config import TRL_REWARD_NAMES
from prefixdpo.errors import ConfigError


def trl_reward(name: str):
    """The reward TRL's script registers under `name`."""
    import trl.rewards as rewards

    if name == "get_soft_overlong_punishment":
        return rewards.get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
    return getattr(rewards, name)


def imported_reward(spec: str):
    """The function named by `module:function` / `module.function`; ConfigError naming what is missing."""
    module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"reward_funcs: {spec!r} is neither one of TRL's rewards ({', '.join(TRL_REWARD_NAMES)}) "
                          "nor module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ConfigError(f"reward_funcs: {spec!r}: no module named {err.name!r}") from None
    func = getattr(module, attr, None)
    if not callable(func):
        raise ConfigError(f"reward_funcs: {spec!r}: module {module_name!r} has no function {attr!r}")
    return func


def is_reward_model_name(name: str) -> bool:
    """Whether `name` names a reward model (a folder with a saved model, or a hub id `org/name`); a folder without
    a model in it is a ConfigError."""
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(f"reward_funcs: {name!r} is a folder without a saved model (no config.json)")
        return True
    return "/" in name and ":" not in name and not name.startswith((".", "/", "~")) and not os.path.exists(name)


def resolve_rewards(names: list[str] | None, reward_model: str | None) -> list:
    """TRL's `reward_funcs` list: the reward model's name first (TRL loads it), then each named function."""
    rewards = [reward_model] if reward_model else []
    for name in names or []:
        if name in TRL_REWARD_NAMES:
            rewards.append(trl_reward(name))
        else:
            rewards.append(name if is_reward_model_name(name) else imported_reward(name))
    if not rewards:
        raise ConfigError("no reward: name --reward_funcs (TRL's names or module:function) or "
                          "--reward_model_name_or_path")
    return rewards
