"""TRL 1.16 `RewardConfig` compatibility of `PrefixRewardConfig`: every TRL field with TRL's type and default
(a new TRL field fails here), TRL's reward defaults resolving on CPU to fp32 without warnings, YAML + command
line options for `prefixdpo reward`, and one-line errors for bad values."""

from __future__ import annotations

import dataclasses
import warnings
from typing import get_type_hints

import pytest

from prefixdpo.errors import ConfigError
from prefixdpo.commands.reward import parse_reward_args
from prefixdpo import PrefixRewardConfig

trl = pytest.importorskip("trl")

DEFAULT_EXCEPTIONS = {"output_dir": "prefixdpo-output"}  # where the run is written (as PrefixDPOConfig)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_every_trl_rewardconfig_field_is_ours_with_trls_type_and_default():
    ours = {f.name: f for f in dataclasses.fields(PrefixRewardConfig)}
    our_types, trl_types = get_type_hints(PrefixRewardConfig), get_type_hints(trl.RewardConfig)
    wrong = []
    for f in dataclasses.fields(trl.RewardConfig):
        if f.name not in ours:
            wrong.append(f"{f.name}: missing")
            continue
        if our_types[f.name] != trl_types[f.name]:
            wrong.append(f"{f.name}: type {our_types[f.name]} != TRL's {trl_types[f.name]}")
        expected = DEFAULT_EXCEPTIONS.get(f.name, _default(f))
        if _default(ours[f.name]) != expected:
            wrong.append(f"{f.name}: default {_default(ours[f.name])!r} != {expected!r}")
    assert not wrong, "\n".join(wrong)
    for name, value in (("learning_rate", 1e-4), ("max_length", 1024), ("center_rewards_coefficient", None),
                        ("disable_dropout", True), ("gradient_checkpointing", True)):
        assert _default(ours[name]) == value, name


def test_defaults_resolve_on_cpu_without_warnings(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = PrefixRewardConfig(output_dir=str(tmp_path), use_cpu=True)
    assert args.bf16 is False and args.activation_checkpointing is True
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False} and args.ddp_find_unused_parameters is False
    assert args.pad_to_multiple_of is None


def test_yaml_then_command_line(tmp_path):
    path = tmp_path / "rm.yaml"
    path.write_text("center_rewards_coefficient: 0.01\nmax_length: 256\npacking: true\npairs_policy: best_vs_each\n")
    config, model, data = parse_reward_args([str(path), "--max_length", "128", "--model", "m", "--use_peft",
                                             "--lora_r", "8", "--use_cpu"])
    assert (config.center_rewards_coefficient, config.max_length, config.packing) == (0.01, 128, True)
    assert model.model_name_or_path == "m" and model.peft_config().task_type == "SEQ_CLS"
    assert data.pairs_policy == "best_vs_each" and data.overlong == "drop"  # TRL filters long records


@pytest.mark.parametrize("argv,message", [
    (["--attention", "nope"], "attention='nope'"),
    (["--center_rewards_coefficient", "-1"], "center_rewards_coefficient=-1.0"),
    (["--pack_length", "x"], "pack_length"),
    (["--train_sampling_strategy", "group_by_length"], "train_sampling_strategy"),
    (["--loss_type", "sigmoid"], "--loss_type"),
])
def test_bad_options_are_one_line_config_errors(argv, message):
    with pytest.raises(ConfigError, match="^[^\\n]*$") as err:
        parse_reward_args(["--use_cpu", *argv])
    assert message in str(err.value)
