"""The documentation (README.md and the mkdocs site in docs/) stays true to the code.

- `mkdocs build --strict` passes: every page is in the navigation and every link between pages and to an anchor
  resolves (mkdocs.yml's `validation` makes each of those a warning, `strict` a failure); README's links to docs/
  name files that exist.
- Every `prefixdpo COMMAND ...` line in a code block of README.md or docs/ (also behind torchrun/accelerate, with
  `\\` continuations and quoted JSON over several lines) parses with that command's own parser: the training
  commands' option dataclasses (`commands.recipe.Recipe.parse`, a placeholder `config.yaml` given as an empty YAML
  file, `...` dropped), the others' argparse parsers. `--use_cpu true` is added to the training commands: a
  documented `--bf16 true` is refused on a machine without a GPU, which is the machine's, not the documentation's.
About 10 s.
"""

from __future__ import annotations

import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = ("train", "reward", "grpo", "rloo", "verify", "inspect", "bench")
TRAINING = ("train", "reward", "grpo", "rloo")


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command, its arguments) of every documented `prefixdpo COMMAND ...` line in a code block."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|console|sh|shell)?\n(.*?)```", page.read_text(), re.S):
            lines, pending = [], ""
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                pending = f"{pending} {line.strip()}" if pending else line.strip()
                try:
                    shlex.split(re.sub(r"\s#.*$", "", pending))
                except ValueError:  # a quote left open: the command goes on on the next line
                    continue
                lines.append(pending)
                pending = ""
            for line in lines:
                match = re.search(rf"(?:^|\s)(?:\S*/)?prefixdpo(?:\.cli)?\s+({'|'.join(COMMANDS)})\b(.*)",
                                  re.sub(r"^\$ ", "", line))
                if match and not line.startswith("#"):
                    argv = [a for a in shlex.split(re.sub(r"\s#.*$", "", match.group(2))) if a != "..."]
                    found.append((page.name, match.group(1), argv))
    return found


def test_the_site_builds_strictly_and_readme_links_exist(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    links = re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text())
    assert links and all((ROOT / link).is_file() for link in links), links


def test_every_documented_command_parses(tmp_path, monkeypatch):
    from prefixdpo.cli import build_parser

    commands = documented_commands()
    assert {command for _, command, _ in commands} == set(COMMANDS)  # every command is documented somewhere
    assert len(commands) >= 30
    (tmp_path / "config.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    for page, command, argv in commands:
        if command in TRAINING:
            if "--help" in argv:
                continue
            recipe = importlib.import_module(f"prefixdpo.commands.{command}").RECIPE
            recipe.parse([*argv, "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"])
        else:
            _, extra = parser.parse_known_args([command, *argv])
            assert not extra, (page, command, argv, extra)
