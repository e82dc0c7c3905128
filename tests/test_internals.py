"""The private names prefixdpo uses (`prefixdpo.training.internals`) against the installed transformers, TRL and
accelerate: each test failure names the name that changed, so an upgrade that breaks one says where at once."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from prefixdpo.training.internals import PRIVATE_NAMES, PrivateName

SRC = Path(__file__).resolve().parents[1] / "src"  # the library (prefixdpo) and the tools beside it


def resolve(dotted: str):
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _sets_attribute(owner, name: str) -> bool:
    """The owner class (or one of its bases) assigns `self.<name>` in its source, or has it as a class attribute."""
    if name in dir(owner):
        return True
    for cls in inspect.getmro(owner):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{name}\s*(:[^=\n]*)?=[^=]", source):
            return True
    return False


@pytest.mark.parametrize("entry", PRIVATE_NAMES, ids=lambda e: e.dotted)
def test_private_name_is_as_prefixdpo_uses_it(entry: PrivateName):
    owner = resolve(entry.owner)
    if entry.parameters is None and inspect.isclass(owner):  # an attribute its owner sets up
        assert _sets_attribute(owner, entry.name), f"{entry.dotted} is no longer set by {entry.owner} ({entry.why})"
        return
    assert hasattr(owner, entry.name), f"{entry.dotted} no longer exists ({entry.where} {entry.use}s it: {entry.why})"
    if entry.parameters is None:
        assert callable(getattr(owner, entry.name)), f"{entry.dotted} is no longer callable"
        return
    names = tuple(inspect.signature(getattr(owner, entry.name)).parameters)
    assert names[:len(entry.parameters)] == entry.parameters, (
        f"{entry.dotted} now takes {names}, prefixdpo's {entry.use} in {entry.where} relies on {entry.parameters}")


def _our_trainer_classes():
    from prefixdpo.dpo.trainer import PrefixDPOTrainer
    from prefixdpo.grpo.trainer import PrefixGRPOTrainer, PrefixRLOOTrainer
    from prefixdpo.reward.trainer import PrefixRewardTrainer

    return PrefixDPOTrainer, PrefixRewardTrainer, PrefixGRPOTrainer, PrefixRLOOTrainer


def _private_overrides(cls) -> set[str]:
    """'owner.name' of each private method a prefixdpo class in `cls`'s MRO defines over a library class's."""
    ours = [b for b in cls.__mro__ if b.__module__.startswith("prefixdpo")]
    theirs = [b for b in cls.__mro__ if b.__module__.split(".")[0] in ("transformers", "trl", "accelerate")]
    found = set()
    for mine in ours:
        for name in vars(mine):
            if not name.startswith("_") or name.startswith("__"):
                continue
            owner = next((b for b in theirs if name in vars(b)), None)
            if owner is not None and name not in ("_VALID_DICT_FIELDS",):
                found.add(f"{owner.__module__}.{owner.__qualname__}.{name}")
    return found


@pytest.mark.parametrize("cls", _our_trainer_classes(), ids=lambda c: c.__name__)
def test_every_private_override_is_listed(cls):
    listed = {e.dotted for e in PRIVATE_NAMES if e.use == "override"}
    missing = _private_overrides(cls) - listed
    assert not missing, f"{cls.__name__} overrides private names not in training/internals.py: {sorted(missing)}"


def test_every_private_super_call_and_import_is_listed():
    """`super()._name(` anywhere in src/ and `from transformers/trl/accelerate... import _name` name a listed name."""
    listed = {e.name for e in PRIVATE_NAMES}
    unlisted = []
    for path in [*(SRC / "prefixdpo").rglob("*.py"), *(SRC / "prefixdpo_tools").rglob("*.py")]:
        text = path.read_text()
        names = re.findall(r"super\(\)\.(_[a-z]\w*)\(", text)
        names += re.findall(r"from (?:transformers|trl|accelerate)[\w.]* import (_[a-z]\w*)", text)
        unlisted += [f"{path.relative_to(SRC)}: {name}" for name in names if name not in listed]
    assert not unlisted, f"private names used but not in training/internals.py: {unlisted}"


def test_a_changed_signature_is_named(monkeypatch):
    """The check fails, naming the name, when a library's method loses a parameter prefixdpo passes."""
    import transformers

    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", lambda self, model: None)
    entry = next(e for e in PRIVATE_NAMES if e.name == "_save_checkpoint")
    with pytest.raises(AssertionError, match=r"transformers\.trainer\.Trainer\._save_checkpoint now takes"):
        test_private_name_is_as_prefixdpo_uses_it(entry)
    monkeypatch.delattr(transformers.Trainer, "_save_checkpoint")
    with pytest.raises(AssertionError, match=r"_save_checkpoint no longer exists"):
        test_private_name_is_as_prefixdpo_uses_it(entry)
