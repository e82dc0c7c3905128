"""The wrapper installed on each recurrent mixer: with a pass plan, the mixer runs run by run from its parent's state.

`install(module)` replaces the module's `forward` (an instance attribute; the class's stays untouched) with a wrapper
that keeps the stock call when no plan comes with it, so generation, the stock reference passes of `verify` and every
caller that does not pass `pass_plan=` see the model unchanged. A decoding plan (`pass_plan.decoding_plan`: GRPO's
decoding over prompts held once, whose plan every layer receives) is for the attention layers: the mixer runs its
stock forward over the cache then too.

With `pass_plan=` (an object whose `spans` is [B, L, 2] long, `data.lines`), the mixer's own forward runs once per
group of calls (`calls.plan_calls`, stacked as a batch): a root group from no state (the
mixer's own zero-state path), every deeper group from its parents' final states, handed in through a `RunStates`
cache. The outputs go back to their columns with one gather; padding columns get zeros (nothing real reads them: they
are no run's parent, and the attention rule gives them no real key).

The recurrent layer's own `attention_mask` (its 2D padding mask) is not passed on with a plan: a call holds no padding,
and prefixdpo hands the model a 4D mask, for which transformers' `create_recurrent_attention_mask` gives the recurrent
layers None anyway.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from prefixdpo.core.recurrent.calls import CallPlan, plan_calls
from prefixdpo.core.recurrent.spans import walk_spans
from prefixdpo.core.recurrent.states import RunStates

# kwargs of a whole-line pass that must not reach a call over some of its columns: flash varlen's sequence lengths
_LINE_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens")

# every layer of a pass plans the same spans once: (spans, (their column offset, roots from a state), the plan)
_last_plan: tuple[torch.Tensor, tuple[int, bool], CallPlan] | None = None


def call_plan(spans: torch.Tensor, offset: int = 0, roots_from_state: bool = False) -> CallPlan:
    """The `CallPlan` of lines with node spans `spans` [B, L, 2] whose first column is column `offset` of its line (a
    chunk of prefix reuse: its spans count from the prefix's start), remembered for the last spans tensor (the same
    object reaches every layer of a pass, and gradient checkpointing's recompute)."""
    global _last_plan
    options = (offset, roots_from_state)
    if _last_plan is None or _last_plan[0] is not spans or _last_plan[1] != options:
        B, L = spans.shape[:2]
        own = torch.where(spans >= 0, spans - offset, spans) if offset else spans
        plan = plan_calls(walk_spans(own), B, L, roots_from_state=roots_from_state)
        # the gathers' indices where the pass runs, moved once rather than per layer and group
        plan = replace(plan, rows=tuple(r.to(spans.device) for r in plan.rows), index=plan.index.to(spans.device))
        _last_plan = (spans, options, plan)
    return _last_plan[2]


def _root_states(layer_idx: int, n: int, initial: tuple[dict, dict] | None) -> RunStates:
    """The initial states of n root calls: the zero state, or `initial` (a prefix's final states, [1, ...] each)
    repeated for each (a copy: no call writes into the prefix's own)."""
    if initial is None:
        return RunStates(layer_idx)
    conv, recurrent = ({k: v.repeat(n, *[1] * (v.dim() - 1)) for k, v in states.items() if v is not None}
                       for states in initial)
    return RunStates(layer_idx, conv, recurrent)


def _parent_states(calls, group, finals, group_states, layer_idx: int, initial=None) -> RunStates:
    """The initial states of a group of calls: their parents' final states, stacked in the group's order (roots:
    `_root_states`)."""
    if calls[group[0]].parent < 0:  # a group is all roots or all children (one depth)
        return _root_states(layer_idx, len(group), initial)
    conv: dict[int, list[torch.Tensor]] = {}
    recurrent: dict[int, list[torch.Tensor]] = {}
    for c in group:
        g, row = finals[calls[c].parent]
        for target, source in ((conv, group_states[g].conv), (recurrent, group_states[g].recurrent)):
            for k, v in source.items():
                if v is not None:
                    target.setdefault(k, []).append(v[row:row + 1])
    return RunStates(layer_idx, {k: torch.cat(v) for k, v in conv.items()},
                     {k: torch.cat(v) for k, v in recurrent.items()})


def run_forward(original, layer_idx: int, hidden_states: torch.Tensor, plan, kwargs: dict) -> torch.Tensor:
    """The mixer `original` over lines of runs: hidden_states [B, L, H] -> [B, L, H_out] (module docstring)."""
    B, L, H = hidden_states.shape
    if tuple(plan.spans.shape[:2]) != (B, L):  # e.g. a rank's columns under sequence parallelism
        raise NotImplementedError(
            f"a recurrent layer with a pass plan runs whole lines: its input holds {B} x {L} columns, the plan's "
            f"spans {plan.spans.shape[0]} x {plan.spans.shape[1]} (a recurrence cannot be split over ranks by "
            "columns)")
    store = getattr(plan, "prefix_kv", None)  # prefix reuse: the prefix's pass records its final states, chunks read
    initial = None if store is None or store.recording else store.states[layer_idx]
    calls_plan = call_plan(plan.spans, getattr(plan, "queries_from", 0), roots_from_state=initial is not None)
    calls = calls_plan.calls
    kwargs = {k: v for k, v in kwargs.items() if k not in _LINE_KWARGS}
    flat_in = hidden_states.reshape(B * L, H)
    outputs: list[torch.Tensor] = []
    finals: dict[int, tuple[int, int]] = {}  # call -> (its group, its row in the group's states)
    group_states: list[RunStates] = []
    for group, width, rows in zip(calls_plan.groups, calls_plan.widths, calls_plan.rows):
        x = flat_in[rows].view(len(group), width, H)
        states = _parent_states(calls, group, finals, group_states, layer_idx, initial)
        y = original(x, cache=states, attention_mask=None, **kwargs)
        if isinstance(y, tuple):  # a mixer returning (output, extras): only the output is per column
            y = y[0]
        outputs.append(y.reshape(-1, y.shape[-1]))
        for row, c in enumerate(group):
            finals[c] = (len(group_states), row)
        group_states.append(states)
    if store is not None and store.recording:
        store.states[layer_idx] = _prefix_final_states(calls, finals, group_states, L)
    flat_out = torch.cat(outputs + [outputs[0].new_zeros(1, outputs[0].shape[-1])])
    return flat_out[calls_plan.index].view(B, L, -1)


def _prefix_final_states(calls, finals, group_states, length: int) -> tuple[dict, dict]:
    """The final states [1, ...] of the call that ends a prefix's pass (one line of `length` columns, a chain: its
    last column's call), as ({state_idx: conv state}, {state_idx: recurrent state})."""
    last = next(c for c, call in enumerate(calls) if call.line == 0 and call.columns[-1] == length - 1)
    g, row = finals[last]
    return tuple({k: v[row:row + 1] for k, v in states.items() if v is not None}
                 for states in (group_states[g].conv, group_states[g].recurrent))


def _stock_forward(module):
    """The mixer's own forward, bound to it: an instance forward it had before `install` (an accelerate hook's), else
    its stock class's (with that class's decorators: kwarg renames, accelerate's forced hooks)."""
    own = module.__dict__.get("_prefixdpo_stock_forward")
    return own if own is not None else super(type(module), module).forward


def _recurrent_forward(self, hidden_states, *args, **kwargs):
    """The forward of a wrapped mixer `self`: its stock forward without a plan, else run by run (`run_forward`)."""
    plan = kwargs.pop("pass_plan", None)
    # a decoding step over prompts held once (`pass_plan.decoding_plan`) concerns attention only: the mixer decodes
    # from its cache, stock
    if plan is None or getattr(plan, "shared_prompt", None) is not None:
        return _stock_forward(self)(hidden_states, *args, **kwargs)
    cache = kwargs.pop("cache", None) if "cache" in kwargs else kwargs.pop("cache_params", None)
    if args or cache is not None:
        raise NotImplementedError(
            f"{type(self).__name__} with a pass plan runs only whole lines from the zero state (no cache, "
            "keyword arguments only)")
    kwargs.pop("attention_mask", None)
    return run_forward(_stock_forward(self), self.layer_idx, hidden_states, plan, kwargs)


def _never_kernelize(module) -> bool:
    """`kernels`' condition for replacing a layer's forward with a hub kernel's: never for a wrapped mixer."""
    return False


_WRAPPED: dict[type, type] = {}  # stock mixer class -> its wrapped subclass


def _wrapped_class(cls: type) -> type:
    """The subclass of mixer class `cls` whose forward is `_recurrent_forward` (made once; named as `cls`, so
    `SUPPORTED_MIXERS` and messages read the same, and importable under its qualified name, so a pickled model loads).

    A subclass rather than an instance attribute: transformers re-kernelizes a model whose `use_kernels` is on at every
    `train()`/`eval()` (hub `kernels`' `kernelize`, which resets each kernel layer's instance forward; measured: a GRPO
    policy's Gated DeltaNet lost its wrapper there and ran its stock forward along the shared line), and a deepcopy
    (a reference copy) keeps the class. Its `kernel_condition` keeps `kernelize` off it: a hub kernel's forward would
    not take a parent's state."""
    sub = _WRAPPED.get(cls)
    if sub is None:
        qualname = f"Recurrent{cls.__name__}"
        sub = type(cls.__name__, (cls,), {"forward": _recurrent_forward, "kernel_condition": _never_kernelize,
                                          "__module__": __name__, "__qualname__": qualname})
        globals()[qualname] = sub
        _WRAPPED[cls] = sub
    return sub


def install(module: torch.nn.Module) -> bool:
    """Wrap `module` (once) so a call with `pass_plan=` runs run by run; True if newly wrapped (`_wrapped_class`)."""
    if type(module) in _WRAPPED.values():
        return False
    own = module.__dict__.pop("forward", None)  # an instance forward (a hook's) would shadow the class's: keep it
    if own is not None:
        module._prefixdpo_stock_forward = own
    module.__class__ = _wrapped_class(type(module))
    module._prefixdpo_recurrent = True
    return True
