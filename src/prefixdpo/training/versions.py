"""The versions prefixdpo runs with: `prefixdpo --version`, and one warning line at start when an installed library
prefixdpo reaches into (`training/internals.py`) is outside the range its test suite passed.

The ranges are `pyproject.toml`'s own (read back from the installed package's metadata, so they are written once):
upper bounds on transformers, TRL and accelerate, whose private methods the trainers override or call. A version
outside is warned about, not refused: a newer TRL may well work, and the user is the one to decide; the line says
what to install to be on the tested path. Imports nothing heavy (no torch, no transformers): it runs before them.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

__all__ = ["CHECKED", "SHOWN", "installed_version", "tested_ranges", "untested", "version_report",
           "warn_if_untested"]

CHECKED = ("transformers", "trl", "accelerate")  # whose private internals the trainers use (training/internals.py)
SHOWN = ("torch", "transformers", "trl", "accelerate", "datasets", "peft", "deepspeed")  # --version's lines


def installed_version(name: str) -> str | None:
    """The installed distribution's version, or None where it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def tested_ranges() -> dict[str, Requirement]:
    """{library: its requirement in prefixdpo's metadata (pyproject.toml's `dependencies`)}; empty where prefixdpo
    runs from a source tree without being installed (nothing to compare with)."""
    try:
        requires = metadata.requires("prefixdpo") or []
    except metadata.PackageNotFoundError:
        return {}
    ranges = {}
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is None:  # extras (dev) are not the run's dependencies
            ranges[requirement.name.lower()] = requirement
    return ranges


def untested() -> list[tuple[str, str, Requirement]]:
    """(name, installed version, tested requirement) of each library of `CHECKED` installed outside its range."""
    ranges, found = tested_ranges(), []
    for name in CHECKED:
        version, requirement = installed_version(name), ranges.get(name)
        if version is None or requirement is None:
            continue
        try:
            inside = requirement.specifier.contains(Version(version), prereleases=True)
        except InvalidVersion:
            inside = False
        if not inside:
            found.append((name, version, requirement))
    return found


def warn_if_untested(command: str, stream=None) -> None:
    """One line on stderr (the first process only) when `untested()` finds a library outside its range."""
    import os

    found = untested()
    if not found or os.environ.get("RANK", "0") != "0":
        return
    named = "; ".join(f"{name} {version} (tested: {requirement})" for name, version, requirement in found)
    pins = " ".join(f"'{requirement}'" for _, _, requirement in found)
    print(f"prefixdpo {command}: warning: {named} {'is' if len(found) == 1 else 'are'} outside the versions "
          f"prefixdpo {installed_version('prefixdpo')} was tested with and may fail inside a step: "
          f"pip install {pins} for the tested ones", file=stream or sys.stderr, flush=True)


def version_report() -> str:
    """`prefixdpo --version`: prefixdpo's version, then each library's, with its tested range where it has one."""
    ranges, outside_names = tested_ranges(), {name for name, _, _ in untested()}
    lines = [f"prefixdpo {installed_version('prefixdpo') or 'not installed (run from source)'}",
             f"python {sys.version.split()[0]}"]
    for name in SHOWN:
        version = installed_version(name) or "not installed"
        tested = f"  (tested: {ranges[name]})" if name in ranges else ""
        outside = "  <- outside the tested range" if name in outside_names else ""
        lines.append(f"{name} {version}{tested}{outside}")
    return "\n".join(lines)
