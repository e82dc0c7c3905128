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


def test_a_finished_command_ends_its_process_group(monkeypatch, tmp_path):
    """Under torchrun a command that finished ends its process group itself (gloo's threads stopped before the
    interpreter finalises); a command that failed leaves it (its peers are told by its exit)."""
    import torch.distributed as dist

    from prefixdpo import cli

    def finished(args):
        assert dist.is_initialized()
        return 0

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(finished))
        assert cli.main(["job"]) == 0
        assert not dist.is_initialized()
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store2"), 1), rank=0, world_size=1)

        def failed(args):
            raise ConfigError("a bad option")

        monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(failed))
        assert cli.main(["job"]) == 2
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _parser_running(func):
    import argparse

    parser = argparse.ArgumentParser(prog="prefixdpo")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("job").set_defaults(func=func)
    return parser
