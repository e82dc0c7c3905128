"""`prefixdpo` error handling: a user error is one line on stderr and exit code 2; any other exception is a
bug and keeps its traceback (exit code 1)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from prefixdpo.cli import main
from prefixdpo.errors import ConfigError, UserError


def test_bad_train_option_is_one_line_and_exit_2(capsys):
    assert main(["train", "--lora_r", "eight", "--output-dir", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["prefixdpo train: error: argument --lora_r/--lora-r: invalid int value: 'eight'"]


def test_user_error_raised_inside_a_command_is_one_line_and_exit_2(monkeypatch, capsys):
    import prefixdpo.commands.train

    def bad_record(*args, **kwargs):
        raise UserError("record 3: chosen and rejected are identical\n(second line of detail)")

    monkeypatch.setattr(prefixdpo.commands.train, "parse_train_args", bad_record)
    assert main(["train"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["prefixdpo train: error: record 3: chosen and rejected are identical (second line of detail)"]


@pytest.mark.parametrize("error", [ValueError, RuntimeError, KeyError])
def test_internal_error_propagates_in_process(monkeypatch, error):
    import prefixdpo.commands.train

    def broken(*args, **kwargs):
        raise error("internal bug")

    monkeypatch.setattr(prefixdpo.commands.train, "parse_train_args", broken)
    with pytest.raises(error, match="internal bug"):
        main(["train"])


def test_internal_error_prints_traceback_and_exits_1():
    """As the console script runs it: a ValueError that is not a UserError is a bug, not bad input."""
    script = textwrap.dedent("""
        import sys
        import prefixdpo.commands.train
        from prefixdpo.cli import main

        def broken(*args, **kwargs):
            raise ValueError("internal bug")

        prefixdpo.commands.train.parse_train_args = broken
        sys.exit(main(["train"]))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1, run.stderr
    assert "Traceback (most recent call last)" in run.stderr and "ValueError: internal bug" in run.stderr
    assert "prefixdpo train: error" not in run.stderr


def test_config_error_is_a_user_error_and_a_value_error():
    assert issubclass(ConfigError, UserError) and issubclass(UserError, ValueError)
