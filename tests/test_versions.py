"""Upgrades (issue 35, findings 10-11): `prefixdpo --version`, the one-line warning when TRL / transformers /
accelerate is outside the tested range, `make gpu-check` on a python without torch, and no DeepSpeed warning on a
CPU run that does not use it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixdpo import cli
from prefixdpo.training import versions

ROOT = Path(__file__).resolve().parents[1]


def _job_parser(func):
    import argparse

    parser = argparse.ArgumentParser(prog="prefixdpo")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("job").set_defaults(func=func)
    return parser


def test_version_prints_prefixdpo_and_each_library_with_its_tested_range(capsys):
    assert cli.main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"prefixdpo {versions.installed_version('prefixdpo')}"
    by_name = {line.split()[0]: line for line in lines[1:]}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "peft"):
        assert by_name[name].startswith(f"{name} {versions.installed_version(name)}"), by_name[name]
    for name in versions.CHECKED:  # bounded above in pyproject.toml: private internals (training/internals.py)
        assert "(tested: " in by_name[name] and "<" in by_name[name], by_name[name]
        assert "outside" not in by_name[name]  # the suite runs on the tested versions


def test_installed_libraries_are_inside_the_tested_ranges():
    """The suite's own environment is the tested one: a range in pyproject.toml that excludes it is a wrong range."""
    assert versions.untested() == []
    assert set(versions.CHECKED) <= set(versions.tested_ranges())


def test_a_library_outside_its_range_is_one_warning_line_and_the_command_still_runs(monkeypatch, capsys):
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version",
                        lambda name: {"trl": "1.17.0", "transformers": "6.0.0"}.get(name) or real(name))
    ran = []
    monkeypatch.setattr(cli, "build_parser", lambda: _job_parser(lambda args: ran.append(1) or 0))
    assert cli.main(["job"]) == 0 and ran == [1]
    err = capsys.readouterr().err.splitlines()
    ranges = versions.tested_ranges()
    assert err == [f"prefixdpo job: warning: transformers 6.0.0 (tested: {ranges['transformers']}); trl 1.17.0 "
                   f"(tested: {ranges['trl']}) are outside the versions prefixdpo "
                   f"{real('prefixdpo')} was tested with and may fail inside a step: pip install "
                   f"'{ranges['transformers']}' '{ranges['trl']}' for the tested ones"]


def test_inside_the_ranges_nothing_is_said(monkeypatch, capsys):
    monkeypatch.setattr(cli, "build_parser", lambda: _job_parser(lambda args: 0))
    assert cli.main(["job"]) == 0
    assert capsys.readouterr().err == ""


def test_gpu_check_on_a_python_without_torch_is_one_line():
    """`make gpu-check` where python3 has no torch (it stands in: torch made unimportable) says so in one line."""
    code = ("import runpy, sys\n"
            "sys.modules['torch'] = None\n"
            "sys.argv = ['gpu_check', '--out', 'unused']\n"
            "runpy.run_module('prefixdpo_tools.gpu_check', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["gpu-check: torch is not installed for this python: nothing checked"]
    assert proc.stderr == ""


@pytest.mark.parametrize("named", [True, False])
def test_deepspeed_says_nothing_on_a_cpu_run_once_its_accelerator_is_named(named):
    """accelerate imports DeepSpeed wherever it is installed; on a CPU machine its accelerator probe warns, unless
    prefixdpo named it first (what `run_command` does). The unnamed case shows the warning is real."""
    code = ("from prefixdpo.core.engines import name_deepspeed_accelerator\n"
            f"{'name_deepspeed_accelerator()' if named else ''}\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "print(get_accelerator().device_name())\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "cpu"
    said = "Setting accelerator to CPU" in proc.stdout + proc.stderr
    assert said is not named
