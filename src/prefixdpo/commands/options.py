"""The command line and YAML options of every prefixdpo command, read by TRL's `TrlParser` into the command's
option dataclasses (`parse_options`). Imported by the commands only: TRL is needed to parse options, not to
train through the Python API.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import get_args, get_origin, get_type_hints

from trl import TrlParser

from prefixdpo.errors import ConfigError, UserError


def json_object(text: str) -> dict | None:
    """A dict option's command-line value: a JSON object (`'{"rope": true}'`) or none."""
    if text.lower() in ("none", "null"):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value



class OptionParser(TrlParser):
    """The options of a prefixdpo command: every field of its option dataclasses (a method's config, model
    and data arguments).

    TRL's `TrlParser` (an `HfArgumentParser` whose `T | None` options also take `none`, e.g.
    `--max_length none`), plus:
    - every boolean option X takes `--X`, `--X true|false` and `--no_X` (HfArgumentParser adds `--no_X`
      only where X defaults to True, and `--X` alone only where the default is not None);
    - no abbreviations: a misspelt option is an error, never a silent match of a longer one;
    - every parse error raises `ConfigError` (one line) instead of printing usage and exiting.
    Options are spelled with underscores or dashes (`--lora_r 8` == `--lora-r 8`).
    """

    def __init__(self, dataclass_types, **kwargs):
        super().__init__(tuple(dataclass_types), allow_abbrev=False, **kwargs)
        for dc in self.dataclass_types:
            hints = get_type_hints(dc)
            for f in fields(dc):
                hint = hints[f.name]
                if f.init and (hint is bool or bool in get_args(hint)):
                    self._complete_bool_option(f.name)
                elif f.init and str not in get_args(hint) and dict in map(get_origin, (hint, *get_args(hint))):
                    # HfArgumentParser calls dict(text), which no text passes; `dict | str` fields take JSON already
                    self._option_string_actions[f"--{f.name}"].type = json_object
        self.configured: set[str] = set()  # options the config file sets

    def _complete_bool_option(self, name: str) -> None:
        action = self._option_string_actions[f"--{name}"]
        action.nargs, action.const = "?", True
        if f"--no_{name}" not in self._option_string_actions:
            self.add_argument(f"--no_{name}", f"--no-{name.replace('_', '-')}", action="store_false",
                              dest=name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def error(self, message: str):
        raise ConfigError(message)

    def read_config_file(self, path: str) -> None:
        """YAML (or JSON) `option: value` pairs become the defaults that command-line options override."""
        import yaml

        try:
            with open(path, encoding="utf-8") as fh:
                values = yaml.safe_load(fh) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of option: value at the top level")
        defaults, unknown = {}, []
        for key, value in values.items():
            action = self._option_string_actions.get(f"--{key}")
            if action is None or action.nargs == 0:  # not an option, or a flag like --no_packing / --help
                unknown.append(str(key))
                continue
            if action.nargs == "+" and not isinstance(value, list):
                value = [value]  # `loss_type: sigmoid` is the one-item list
            defaults[action.dest] = value
        if unknown:
            raise ConfigError(f"{path}: unknown option(s) {', '.join(unknown)}")
        self.set_defaults_with_config(**defaults)
        self.configured |= set(defaults)

    def names_model_or_dataset(self, argv: list[str]) -> bool:
        """Whether the config file or `argv` sets the model or the dataset."""
        namespace, _ = self.parse_known_args(argv)
        return namespace.model_name_or_path is not None or namespace.dataset_name is not None

    def parse(self, argv: list[str]) -> tuple:
        """Command-line options over the defaults; unknown options and bad values raise `ConfigError`."""
        namespace, rest = self.parse_known_args(argv)
        options = [a.split("=", 1)[0] for a in rest if a.startswith("--")]
        if options:
            raise ConfigError(f"unknown option(s) {', '.join(options)} (see {self.prog} --help)")
        if rest:
            raise ConfigError(f"unexpected argument(s) {' '.join(rest)}: only the first argument may be a config file")
        try:
            config, model_args, data_args = self.parse_dict(vars(namespace))
        except UserError:
            raise
        except ValueError as err:  # TrainingArguments' own checks of option values and combinations
            raise ConfigError(str(err)) from err
        return config, model_args, data_args


def parse_options(dataclass_types, argv: list[str] | None = None, demo_defaults: dict[str, str] | None = None,
                  **parser_kwargs) -> tuple:
    """Parse `[config.yaml] [--option value ...]` into one instance of each of `dataclass_types`: command-line
    options override the config file's values.

    demo_defaults: option -> value (as typed on the command line), used where neither the config file nor
    the command line sets the option, and only when neither names a model or a dataset (the embedded demo).
    parser_kwargs: passed to `OptionParser` (prog, usage, description of the help).
    """
    argv = list(argv or [])
    parser = OptionParser(dataclass_types, **parser_kwargs)
    if argv and not argv[0].startswith("-"):
        parser.read_config_file(argv.pop(0))
    if demo_defaults and not parser.names_model_or_dataset(argv):
        parser.set_defaults(**{k: v for k, v in demo_defaults.items() if k not in parser.configured})
    return parser.parse(argv)
