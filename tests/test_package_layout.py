"""The package's layout, read from its source with `ast` (nothing is imported): no import circle between its
modules, the library's floors never import the tools or the commands, and the package root holds only the
modules named here.

Floors (the library: what `from prefixdpo import ...` and a training run need): core, data, dpo, reward, grpo,
training. The tools (`prefixdpo_tools`, a package of its own beside the library: bench, gpu-check, the embedded
demos) and the commands (`prefixdpo.commands`, `prefixdpo.cli`) sit on top of them. Imports go down README's order only (`level`).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "prefixdpo"
TOOLS = SRC / "prefixdpo_tools"
FLOORS = ("core", "data", "dpo", "reward", "grpo", "training")
ABOVE_FLOORS = ("prefixdpo_tools", "prefixdpo.commands", "prefixdpo.cli")
ROOT_MODULES = {"__init__", "cli", "errors", "atomic_io"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted([*PACKAGE.rglob("*.py"), *TOOLS.rglob("*.py")])}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that `path` (module `name`) imports, at any depth of its code (a lazy import inside a
    function counts: it runs whenever that function does). `from a import b` names module `a.b` where that is one,
    else `a`; a relative import is resolved against `name`'s package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a module a.b.c: a.b.c; of an attribute: a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (read once per test session)."""
    found = modules()
    known = set(found)
    return {name: imported(path, name, known) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted: the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_graph_sees_imports():
    """The reader finds what it must: a top-level, a lazy and a `from package import module` import."""
    graph = import_graph()
    assert "prefixdpo.errors" in graph["prefixdpo.cli"]  # top level: from prefixdpo.errors import ...
    assert "prefixdpo.commands" in graph["prefixdpo.cli"]
    assert "prefixdpo.grpo.trainer" in graph["prefixdpo.grpo"]  # the package's __init__
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_library_floors_import_neither_tools_nor_commands():
    graph = import_graph()
    wrong = sorted(f"{name} imports {target}" for name, targets in graph.items()
                   if any(under(name, f"prefixdpo.{floor}") for floor in FLOORS)
                   for target in targets if any(under(target, above) for above in ABOVE_FLOORS))
    assert wrong == []


def level(name: str) -> int:
    """Where a module stands in README's order (imports go down it only): the package root's utilities, data, core,
    training, the methods (dpo, reward, grpo: side by side, none imports another), the tools, the commands, the
    command line."""
    if under(name, "prefixdpo_tools"):
        return 5
    top = name.split(".")[1] if "." in name else ""
    return {"": 0, "errors": 0, "atomic_io": 0, "data": 1, "core": 2, "training": 3, "dpo": 4, "reward": 4,
            "grpo": 4, "commands": 6, "cli": 7}[top]


def _floor(name: str) -> str:
    """The package a module's layer is (`prefixdpo.dpo`, `prefixdpo_tools`, ...)."""
    return "prefixdpo_tools" if under(name, "prefixdpo_tools") else ".".join(name.split(".")[:2])


def test_imports_go_down_the_layers():
    graph = import_graph()
    wrong = sorted(f"{name} imports {target}" for name, targets in graph.items() for target in targets
                   if level(target) > level(name)
                   or level(target) == level(name) > 0 and _floor(name) != _floor(target))
    assert wrong == []


def test_tools_import_no_command():
    """The tools wing is below the commands: `prefixdpo bench` runs the bench, the bench never runs a command."""
    graph = import_graph()
    wrong = sorted(f"{name} imports {target}" for name, targets in graph.items() if under(name, "prefixdpo_tools")
                   for target in targets if under(target, "prefixdpo.commands") or target == "prefixdpo.cli")
    assert wrong == []


def test_package_root_modules():
    root = {p.stem for p in PACKAGE.glob("*.py")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert root == ROOT_MODULES
    assert packages == {*FLOORS, "commands"}
    assert {p.name for p in TOOLS.iterdir() if (p / "__init__.py").is_file()} == {"bench", "gpu_check"}


def test_public_names_are_the_trainers_and_configs_of_every_method():
    import prefixdpo
    from prefixdpo import (
        PrefixDPOConfig, PrefixDPOTrainer, PrefixGRPOConfig, PrefixGRPOTrainer, PrefixRewardConfig,
        PrefixRewardTrainer, PrefixRLOOConfig, PrefixRLOOTrainer,
    )
    from prefixdpo.dpo.config import PrefixDPOConfig as dpo_config
    from prefixdpo.dpo.trainer import PrefixDPOTrainer as dpo_trainer
    from prefixdpo.grpo.config import PrefixGRPOConfig as grpo_config
    from prefixdpo.grpo.config import PrefixRLOOConfig as rloo_config
    from prefixdpo.grpo.trainer import PrefixGRPOTrainer as grpo_trainer
    from prefixdpo.grpo.trainer import PrefixRLOOTrainer as rloo_trainer
    from prefixdpo.reward.config import PrefixRewardConfig as reward_config
    from prefixdpo.reward.trainer import PrefixRewardTrainer as reward_trainer

    assert (PrefixDPOConfig, PrefixDPOTrainer, PrefixRewardConfig, PrefixRewardTrainer) == (
        dpo_config, dpo_trainer, reward_config, reward_trainer)
    assert (PrefixGRPOConfig, PrefixGRPOTrainer, PrefixRLOOConfig, PrefixRLOOTrainer) == (
        grpo_config, grpo_trainer, rloo_config, rloo_trainer)
    assert {"PrefixGRPOTrainer", "PrefixRLOOConfig"} <= set(prefixdpo.__all__) & set(dir(prefixdpo))


def test_importing_the_package_loads_no_trainer():
    """The names are loaded on first use (PEP 562): `import prefixdpo` imports neither TRL nor a trainer."""
    import subprocess
    import sys

    code = ("import sys, prefixdpo\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trl', 'transformers') or m.startswith("
            "'prefixdpo.')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:] + proc.stdout
