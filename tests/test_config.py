"""`prefixdpo train`'s option parsing (`OptionParser`, `parse_train_args`): every option the help
prints is accepted, booleans take `--X`, `--X true|false` and `--no_X`, YAML values are defaults that the
command line overrides, and the embedded demo's defaults fill only what neither sets."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from enum import Enum
from typing import get_args, get_type_hints

import pytest
import yaml

from prefixdpo.commands.train import DEMO_DEFAULTS, PARSER_KWARGS
from transformers import TrainingArguments

from prefixdpo.commands.train import parse_train_args
from prefixdpo.dpo.config import DPO_OPTIONS, DPOModelArguments
from prefixdpo import PrefixDPOConfig
from prefixdpo.commands.options import OptionParser
from prefixdpo.training.options import DataArguments
from prefixdpo.errors import ConfigError, UserError

DATACLASSES = (PrefixDPOConfig, DPOModelArguments, DataArguments)
OUR_FIELDS = {f.name for dc in DATACLASSES for f in fields(dc)} - {
    f.name for f in fields(TrainingArguments)
}


def _bool_fields() -> list[str]:
    names = []
    for dc in DATACLASSES:
        hints = get_type_hints(dc)
        names += [f.name for f in fields(dc) if f.init and (hints[f.name] is bool or bool in get_args(hints[f.name]))]
    return names


BOOL_FIELDS = _bool_fields()


@pytest.fixture(scope="module")
def parser():
    return OptionParser(DPO_OPTIONS, **PARSER_KWARGS)


def _namespace(parser, argv):
    namespace, rest = parser.parse_known_args(argv)
    assert rest == [], argv
    return namespace


def test_bool_fields_are_found():
    # the check below must cover ours and TrainingArguments' (incl. `bool | None` ones such as tf32)
    assert {"prefix_sharing", "packing", "precompute_ref_log_probs", "load_in_4bit", "bf16", "tf32",
            "disable_tqdm", "gradient_checkpointing"} <= set(BOOL_FIELDS)
    assert len(BOOL_FIELDS) > 40


@pytest.mark.parametrize("name", BOOL_FIELDS)
def test_every_boolean_option_takes_no_flag_bare_flag_and_value(parser, name):
    dashed = name.replace("_", "-")
    assert getattr(_namespace(parser, [f"--no_{name}"]), name) is False
    assert getattr(_namespace(parser, [f"--no-{dashed}"]), name) is False
    assert getattr(_namespace(parser, [f"--{name}"]), name) is True
    assert getattr(_namespace(parser, [f"--{dashed}", "false"]), name) is False
    assert getattr(_namespace(parser, [f"--{name}=true"]), name) is True


# Booleans that are refused alone: quantized loading trains only adapters (tested with test_trl_model_config.py,
# which also tests that dataset_streaming true is refused)
NEEDS = {"load_in_4bit": ["--use_peft"], "load_in_8bit": ["--use_peft"], "prefix_tree": ["--packing"]}
REFUSED_WHEN_TRUE = {"dataset_streaming"}


def test_boolean_options_of_ours_build_the_config():
    ours = [n for n in BOOL_FIELDS if n in OUR_FIELDS]
    assert "prefix_sharing" in ours and "load_in_4bit" in ours and "use_peft" in ours
    for name in ours:
        cases = [([f"--no_{name}"], False), ([f"--{name}", "false"], False)]
        if name not in REFUSED_WHEN_TRUE:
            cases.append(([f"--{name}", *NEEDS.get(name, [])], True))
        for argv, value in cases:
            objs = parse_train_args(argv)
            dc = next(o for o in objs if hasattr(o, name))
            assert getattr(dc, name) is value, argv
    cfg, _, _ = parse_train_args(["--no-prefix-sharing", "--packing", "--no_disable_dropout"])
    assert (cfg.prefix_sharing, cfg.packing, cfg.disable_dropout) == (False, True, False)


def _help_options(help_text: str) -> list[str]:
    """Option strings of the help's invocation column (not options mentioned in help sentences)."""
    options = []
    for line in help_text.splitlines():
        if line.startswith("  -"):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            options += re.findall(r"(?:^|, )(--?[\w-]+)", invocation)
    return options


def _value_for(action) -> list[str]:
    """A value the option's type accepts (its default where that is one)."""
    if action.nargs == 0 or action.nargs == "?":
        return []
    if action.choices:
        return [str(list(action.choices)[0])]
    default = action.default
    if isinstance(default, list) and default:
        return [str(v) for v in default]
    if default is not None and not isinstance(default, (list, dict)):
        return [str(default)]
    if isinstance(action.type, type) and issubclass(action.type, Enum):
        return [next(iter(action.type)).value]
    for candidate in ("1", "x", '{"a": 1}', "none"):  # the last: objects only a config file can give
        try:
            action.type(candidate)
            return [candidate]
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            continue
    raise AssertionError(f"no value found for {action.option_strings}")


def test_every_option_the_help_prints_parses(parser, capsys):
    parser.print_help()
    options = _help_options(capsys.readouterr().out)
    assert len(options) > 200  # ~130 fields, most in two spellings
    for spelled in ("--model", "--dataset", "--lora-r", "--lora_r", "--prefix_sharing", "--no_prefix_sharing",
                    "--loss_type", "--max_length", "--report_to", "--help"):
        assert spelled in options, spelled
    for option in options:
        if option in ("-h", "--help"):
            continue
        action = parser._option_string_actions[option]
        _namespace(parser, [option, *_value_for(action)])


def test_help_names_the_rules(capsys):
    from prefixdpo.cli import main

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: prefixdpo train [config.yaml]")
    assert "--no_X" in out and "--model" in out and "(default: 0.1)" in out


def test_yaml_values_are_defaults_and_the_command_line_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "beta: 0.2\nloss_type: [sigmoid, sft]\nloss_weights: [1.0, 0.5]\npacking: true\nuse-peft: true\nlora-r: 8\n"
        "learning_rate: 5e-4\n"  # YAML 1.1 reads this as a string: converted like a command-line value
        "model: some/model\nprefix_sharing: false\n"
    )
    cfg, model_args, data_args = parse_train_args([str(path), "--beta", "0.05", "--pack-length", "256",
                                                   "--output-dir", str(tmp_path / "o"), "--lora_r", "4"])
    assert cfg.beta == 0.05 and cfg.loss_type == ["sigmoid", "sft"] and cfg.loss_weights == [1.0, 0.5]
    assert cfg.packing and cfg.pack_length == 256 and cfg.learning_rate == 5e-4 and not cfg.prefix_sharing
    assert model_args.lora_r == 4 and model_args.peft_config().r == 4
    assert model_args.model_name_or_path == "some/model" and data_args.dataset_name is None
    # a boolean set in YAML is overridden both ways on the command line
    cfg, _, _ = parse_train_args([str(path), "--prefix_sharing", "--no-packing"])
    assert cfg.prefix_sharing and not cfg.packing
    # a scalar for a list option is the one-item list
    path.write_text("loss_type: ipo\nloss_weights: 2\n")
    cfg, _, _ = parse_train_args([str(path)])
    assert cfg.loss_type == ["ipo"] and cfg.loss_weights == [2.0]


def test_demo_defaults_fill_only_what_neither_yaml_nor_command_line_sets(tmp_path, monkeypatch):
    reads = []
    real_load = yaml.safe_load
    monkeypatch.setattr(yaml, "safe_load", lambda stream: reads.append(1) or real_load(stream))

    cfg, _, _ = parse_train_args([], demo_defaults=DEMO_DEFAULTS)
    assert cfg.learning_rate == float(DEMO_DEFAULTS["learning_rate"]) and cfg.max_grad_norm == 0
    assert cfg.per_device_train_batch_size == int(DEMO_DEFAULTS["per_device_train_batch_size"])

    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.0005\nbeta: 0.2\n")
    cfg, _, _ = parse_train_args([str(path), "--beta", "0.3", "--num-train-epochs=1"], demo_defaults=DEMO_DEFAULTS)
    assert (cfg.learning_rate, cfg.beta, cfg.num_train_epochs) == (0.0005, 0.3, 1)
    assert cfg.per_device_train_batch_size == int(DEMO_DEFAULTS["per_device_train_batch_size"])
    assert reads == [1]  # the YAML file is read once

    # a model or a dataset (command line or YAML) means no demo: the library defaults apply
    for argv, names in ((["--model", "m"], ("m", None)), (["--dataset=d.jsonl"], (None, "d.jsonl"))):
        cfg, model_args, data_args = parse_train_args(argv, demo_defaults=DEMO_DEFAULTS)
        assert cfg.learning_rate == PrefixDPOConfig.learning_rate and cfg.max_grad_norm == 1.0
        assert (model_args.model_name_or_path, data_args.dataset_name) == names
    path.write_text("dataset_name: d.jsonl\n")
    cfg, _, _ = parse_train_args([str(path)], demo_defaults=DEMO_DEFAULTS)
    assert cfg.learning_rate == PrefixDPOConfig.learning_rate


@pytest.mark.parametrize(
    ("argv", "yaml_text", "message"),
    [
        (["--no-such-option", "1"], None, "unknown option(s) --no-such-option"),
        (["--lora", "8"], None, "unknown option(s) --lora"),  # no abbreviations
        (["--lora_r", "eight"], None, "--lora_r/--lora-r: invalid int value: 'eight'"),
        (["--attention", "fast"], None, "attention='fast'"),
        (["--beta", "0.1", "stray"], None, "unexpected argument(s) stray"),
        (["--packing", "maybe"], None, "--packing"),
        (["--lr_scheduler_type", "sometimes"], None, "--lr_scheduler_type"),
        ([], "beta: 0.1\nbetta: 0.2\n", "unknown option(s) betta"),
        ([], "no_packing: true\n", "unknown option(s) no_packing"),
        ([], "- beta\n", "expected a mapping"),
        ([], "beta: [\n", "not valid YAML"),
    ],
)
def test_bad_options_raise_one_line_config_errors(tmp_path, argv, yaml_text, message):
    if yaml_text is not None:
        path = tmp_path / "c.yaml"
        path.write_text(yaml_text)
        argv = [str(path), *argv]
    with pytest.raises(ConfigError) as info:
        parse_train_args(argv)
    assert message in str(info.value) and "\n" not in str(info.value)
    if yaml_text is not None and "unknown" in message:
        assert str(tmp_path / "c.yaml") in str(info.value)


def test_missing_config_file_and_config_value_errors_are_user_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        parse_train_args([str(tmp_path / "nope.yaml")])
    with pytest.raises(UserError, match="pack_length"):
        PrefixDPOConfig(output_dir=str(tmp_path), pack_length="big")
    assert issubclass(ConfigError, ValueError)  # callers catching ValueError for bad input keep working


def test_sampling_strategies_we_do_not_implement_are_refused(tmp_path):
    from prefixdpo import PrefixDPOConfig
    from prefixdpo.errors import ConfigError

    for strategy in ("random", "sequential"):
        assert PrefixDPOConfig(output_dir=str(tmp_path), train_sampling_strategy=strategy).train_sampling_strategy == strategy
    with pytest.raises(ConfigError, match="train_sampling_strategy='group_by_length'"):
        PrefixDPOConfig(output_dir=str(tmp_path), train_sampling_strategy="group_by_length")
