"""The pass plan (`core.attention.pass_plan`): what a pass runs travels as one object, never as attributes set on
tensors; the attention dispatches on it; deriving a plan makes a new one; a model that drops the `pass_plan`
keyword is refused in one line."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import random_examples, tiny_model
from prefixdpo.core.attention.backends import ATTENTION, BACKENDS
from prefixdpo.core.attention.pass_plan import PassPlan, plan_pass
from prefixdpo.core.attention.prefix_kv import PrefixKV
from prefixdpo.data.batch import build_batch
from test_verify_backends import saved_model  # noqa: F401 (a fixture: a saved tiny Qwen2 and its tokenizer)

SRC = Path(__file__).resolve().parents[1] / "src"
# Names that hold tensors in this code base (the attention's query/key/value, masks, hidden states): an attribute
# set on one of them is a side channel riding on a tensor.
TENSOR_NAMES = {"mask", "attention_mask", "carrier", "key", "keys", "value", "values", "query", "hidden", "logits",
                "tensor", "spans", "input_ids", "position_ids", "ids", "scores", "logps", "t"}
# What torch itself lets one set on a tensor or a parameter (not a side channel).
TORCH_ATTRIBUTES = {"data", "grad", "requires_grad"}
_TENSOR_MAKERS = {"view", "clone", "to", "detach", "reshape", "contiguous", "empty", "zeros", "ones", "full", "tensor",
                  "as_tensor", "cat", "stack", "arange", "new_zeros", "new_empty", "new_ones", "new_full", "expand"}


def _own_nodes(scope: ast.AST):
    """The nodes of `scope` (a module or a function), not those of the functions inside it."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _tensor_names(function: ast.AST) -> set[str]:
    """The names of `function` that hold tensors: TENSOR_NAMES, parameters annotated as tensors, and locals bound by
    a call that makes one (`torch.empty(...)`, `x.view(...)`, ...)."""
    names = set(TENSOR_NAMES)
    args = getattr(function, "args", None)
    for arg in ([*args.posonlyargs, *args.args, *args.kwonlyargs] if args else []):
        if arg.annotation is not None and "Tensor" in ast.unparse(arg.annotation):
            names.add(arg.arg)
    for node in _own_nodes(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr in _TENSOR_MAKERS:
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def tensor_attribute_writes(source: str) -> list[str]:
    """`name.attr = ...` and `setattr(name, ...)` of a tensor-holding name (`_tensor_names`) in `source`, as
    'line: code'."""
    tree = ast.parse(source)
    found = []
    for function in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        names = _tensor_names(function)
        for node in _own_nodes(function):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id in names and target.attr not in TORCH_ATTRIBUTES):
                    found.append(f"{node.lineno}: {ast.unparse(target)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in names):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found))


def test_the_tensor_attribute_check_finds_side_channels():
    """The check below bites on the shapes the side channels had (a carrier tensor, a view of the keys, setattr)."""
    source = '''
def carrier_of(plan, device):
    carrier = torch.empty(2, 1, 0, 0, device=device)
    carrier.prefix_plan = plan
def update(self, k):
    keys = k.view(k.shape)
    keys.shared_prompt = self
def shard(mask: torch.Tensor, sp):
    setattr(mask, "sequence_parallel", sp)
def fine(model, param):
    model.generate = None
    param.data = param.data.float()
'''
    assert [w.split(": ")[1] for w in tensor_attribute_writes(source)] == [
        "carrier.prefix_plan", "keys.shared_prompt", "setattr(mask, 'sequence_parallel', sp)"]


def test_no_attribute_is_set_on_a_tensor_in_src():
    """Everything a pass needs is in its plan (`PassPlan`): no attribute rides on a tensor anywhere in src/."""
    found = {str(path.relative_to(SRC)): writes for path in sorted(SRC.rglob("*.py"))
             if (writes := tensor_attribute_writes(path.read_text(encoding="utf-8")))}
    assert not found, found


def test_no_isinstance_on_what_a_plan_builder_returned():
    """`plan_pass` always returns a `PassPlan`: nothing asks whether it got a reuse plan instead of a mask."""
    hits = [f"{path.relative_to(SRC)}:{n}" for path in sorted(SRC.rglob("*.py"))
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if "isinstance(" in line and "PrefixReuse" in line]
    assert not hits, hits


@pytest.mark.parametrize("backend", ["sdpa", "flex", "segmented", "varlen"])
def test_every_backend_is_one_entry_of_the_dispatch_table(backend):
    batch = build_batch(random_examples(), pad_multiple=8)
    plan = plan_pass(batch, backend)
    assert isinstance(plan, PassPlan) and plan.backend in ATTENTION and backend in BACKENDS
    assert plan.spans.shape == batch.spans.shape and plan.spans.dtype == torch.long  # the contract recurrent layers read
    if backend in ("sdpa", "flex"):  # the model gets the mask a stock attention runs
        assert plan.model_mask() is plan.mask
    else:  # a plan is no mask: a zero-size stand-in, which transformers passes through untouched
        assert plan.model_mask().shape == (batch.input_ids.shape[0], 1, 0, 0)


def test_deriving_a_plan_makes_a_new_one():
    batch = build_batch(random_examples(), pad_multiple=8)
    plan = plan_pass(batch, "sdpa")
    sp, store = object(), PrefixKV()
    shard, recording = plan.for_shard(sp), plan.with_prefix_kv(store)
    assert shard is not plan and shard.sequence_parallel is sp and plan.sequence_parallel is None
    assert recording.prefix_kv is store and plan.prefix_kv is None and shard.mask is plan.mask
    assert plan.for_shard(None) is plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.backend = "flex"
    reuse = plan_pass(batch, "sdpa", max_tokens_per_pass=12)
    assert reuse.reuse is not None and reuse.mask is None and torch.equal(reuse.spans, batch.spans)
    chunk = plan_pass(batch.spans, "sdpa", queries_from=3)
    assert torch.equal(chunk.spans, batch.spans[:, 3:]) and chunk.mask.shape[-2:] == (batch.spans.shape[1] - 3,
                                                                                      batch.spans.shape[1])


def test_a_model_that_drops_the_plan_is_refused_in_one_line(saved_model, monkeypatch, capsys):
    """A model whose layers do not hand the `pass_plan` keyword down to their attention (measured on transformers
    5.25: stablelm and falcon, both refused before for other reasons) is never run where the pass needs its plan (here
    segmented attention, whose mask is a plan): one line naming the model and the way out. The fault: Qwen2's
    attention made to drop the keyword."""
    from transformers.models.qwen2 import modeling_qwen2

    from prefixdpo.cli import main

    original = modeling_qwen2.Qwen2Attention.forward

    def dropping(self, *args, pass_plan=None, **kwargs):
        return original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_qwen2.Qwen2Attention, "forward", dropping)
    assert main(["verify", "--model", saved_model, "--attention", "segmented"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not progress bars
    assert err == ["prefixdpo verify: error: the model (qwen2) does not hand prefixdpo's pass plan (the `pass_plan` "
                   "keyword) to its attention, so prefix-shared lines cannot run on it: use --prefix_sharing false"]
