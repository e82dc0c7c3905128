"""Recurrent layers (convolutions, state spaces, linear attention) of hybrid models on prefix-shared lines, exact.

In a line `[prompt][r1][r2]` the attention rule keeps r2 from seeing r1, but a convolution window or a recurrent
state would run from r1 straight into r2. The exact rule is the tree rule applied to state (DESIGN.md, "Recurrent
layers on shared prefixes"): each run of a line starts from the state where its parent run ends (a root from the
zero state, a response from its prompt's final state, a node of a trie from its parent node's, a packed document
from zero), and gradients reach the parent through that state. Then every response's log-probs and every gradient
equal those of its separate `[prompt][response]` pass.

The pieces:
- `spans.walk_spans`: a line's runs (columns that go through a layer in one call: each the only child of the one
  before), in depth-first order, each with its parent run;
- `states.RunStates`: the cache a mixer reads its initial conv/recurrent states from and writes its final ones to,
  out of place (transformers' own linear-attention cache writes in place: see its docstring);
- `calls.plan_calls`: the mixer calls of those runs, batched (non-leaves by depth and length; all leaves, e.g. the
  responses, in one call padded on the right), with no one-token call from a state (Mamba2's decode path updates
  its state in place after saving it for backward: such a node is folded into its children's calls);
- `mixers.install`: the wrapper put on each recurrent mixer module; with `pass_plan=` the mixer's OWN forward (its
  convolution over `[state | inputs]`, its chunked rule with `initial_state=`, its Mamba2 scan) runs per call group.

Verified on CPU (transformers' torch implementations), fp32, against stock separate passes: tests/test_recurrent_*.
On CUDA the same path calls the kernels transformers picks (`fla`'s chunk rules take `initial_state=`, the
convolution still runs over `[state | inputs]`); not yet run there. A model `kernelize`d with a hub kernel that keeps
the convolution state itself (`causal_conv1d_forward` is replaceable) would bypass the cache: not supported.

How a pass reaches the wrapper: the model is called as `model(..., pass_plan=plan)`, `plan.spans` [B, L, 2] long
((tin, tout) per column, (-1, -1) padding). transformers 5.25 hands an extra keyword of the model's forward to every
decoder layer, and each supported family's decoder layer passes its **kwargs on to its mixer (checked per family in
`SUPPORTED_MIXERS`). The attention layers get prefixdpo's 4D mask as `attention_mask=` as for any model: transformers'
mask functions return a 4D mask unchanged for attention layers and give recurrent layers None
(`create_recurrent_attention_mask` only builds their 2D padding mask from a 2D input), and with a plan the wrapper
ignores the recurrent layer's mask anyway (a run holds no padding).

Call `prepare_recurrent(model)` once before passes with plans; it wraps every supported mixer and refuses a model
with a recurrent layer type it cannot run this way (`unsupported_mixers`, one line naming the type and why). A pass
with a plan must run whole lines from no cache (`use_cache=False`): a cache or a rank's share of the columns is refused.
"""

from __future__ import annotations

import torch

from prefixdpo.core.recurrent.mixers import install
from prefixdpo.core.recurrent.spans import Run, SpanWalk, walk_spans
from prefixdpo.core.recurrent.states import RunStates

# mixer class name -> the model_type it belongs to. Each takes (hidden_states, cache=, attention_mask=, **kwargs),
# is passed its decoder layer's **kwargs (so `pass_plan` reaches it), and talks to its cache only through the
# linear-attention methods `RunStates` answers; each is tested exact in tests/test_recurrent_*.py.
SUPPORTED_MIXERS: dict[str, str] = {
    "Qwen3_5GatedDeltaNet": "qwen3_5_text",
    "Qwen3NextGatedDeltaNet": "qwen3_next",
    "Qwen3_5MoeGatedDeltaNet": "qwen3_5_moe_text",
    "Lfm2ShortConv": "lfm2",
    "Lfm2MoeShortConv": "lfm2_moe",
    "Lfm3ShortConv": "lfm3",
    "NemotronHMamba2Mixer": "nemotron_h",
    "Mamba2Mixer": "mamba2",
    "Zamba2MambaMixer": "zamba2",
    "GraniteMoeHybridMambaLayer": "granitemoehybrid",
    "BambaMixer": "bamba",
    "FalconH1Mixer": "falcon_h1",
    "KimiLinearDeltaAttention": "kimi_linear",
}

_UNTESTED = ("reads its states through the same cache methods as the supported mixers, but has no exactness test "
             "against separate passes yet")
# Mamba (1)'s full-sequence scan: `mamba_selective_scan` (and its Jamba, FalconMamba and Zamba copies) takes no
# initial state; transformers' own comment there says the scan "is WRONG if the cache is not empty". Only its
# one-token step reads a state, so a response could start from its prompt's state only token by token.
_SCAN_WITHOUT_STATE = ("runs its Mamba 1 selective scan from the zero state only, taking no initial state: a response "
                       "could start from its prompt's final state only token by token")
# recurrent mixers of transformers 5.25 that `prepare_recurrent` refuses, with why (one line each)
UNSUPPORTED_MIXERS: dict[str, str] = {
    "RecurrentGemmaRecurrentBlock": "keeps its convolution and RG-LRU states on the module itself, not in a cache, and "
                                    "resets them where position_ids is 0, so no parent's state can be handed to it",
    "MiniMaxLightningAttention": "keeps its state in MiniMax's own cache class, not through the linear-attention "
                                 "cache methods a parent's state is handed in by",
    "RwkvSelfAttention": "takes its state as the model-level `state` tuple of every layer, not per layer through a "
                         "cache",
    **dict.fromkeys(["MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"], _SCAN_WITHOUT_STATE),
    **dict.fromkeys(["BailingHybridDeltaAttention", "Glm5NextTextLinearAttention",
                     "InklingShortConvolution", "Inkling2ShortConvolution", "Inkling2LoopShortConvolution",
                     "LaraMiniGatedDeltaNet", "OlmoHybridGatedDeltaNet", "Qwen4ExpTextGatedDeltaNet"], _UNTESTED),
}


def supported_mixers(model: torch.nn.Module) -> list[str]:
    """The qualified names of `model`'s modules that `prepare_recurrent` wraps."""
    return [name for name, m in model.named_modules() if type(m).__name__ in SUPPORTED_MIXERS]


# The transformers whose mixers read their initial states through the cache methods `RunStates` answers. Measured:
# on transformers 5.17 the same tiny LFM2 and NemotronH lines are off their separate passes by 6e-3 (log-probs) and
# 0.2 (gradients), relative, on CPU and on an H200 alike: the mixers there read another cache API.
STATE_API_SINCE = "5.25"


def state_api_supported() -> bool:
    """Whether this transformers' recurrent mixers take their initial states the way `RunStates` hands them."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release[:2] >= Version(STATE_API_SINCE).release[:2]


def unsupported_mixers(model: torch.nn.Module) -> dict[str, str]:
    """{module class name: why} for `model`'s recurrent mixers that cannot run from a parent's state (every one of
    them on a transformers older than `STATE_API_SINCE`)."""
    refused = {type(m).__name__: UNSUPPORTED_MIXERS[type(m).__name__] for m in model.modules()
               if type(m).__name__ in UNSUPPORTED_MIXERS}
    if not state_api_supported():
        import transformers

        why = (f"transformers {transformers.__version__} hands it its state through another cache API than "
               f"{STATE_API_SINCE}'s, which prefixdpo runs it with (install transformers>={STATE_API_SINCE})")
        refused.update({type(m).__name__: why for m in model.modules() if type(m).__name__ in SUPPORTED_MIXERS})
    return refused


def prepare_recurrent(model: torch.nn.Module) -> list[str]:
    """Wrap every supported recurrent mixer of `model` (idempotent) -> the wrapped modules' names.

    Raises ValueError naming a recurrent layer type that cannot run from a parent's state."""
    refused = unsupported_mixers(model)
    if refused:
        name, why = next(iter(refused.items()))
        raise ValueError(f"{name} cannot share prefixes exactly: {why}")
    names = supported_mixers(model)
    modules = dict(model.named_modules())
    for name in names:
        install(modules[name])
    model._prefixdpo_runs_recurrent = bool(names)  # read by every pass (`runs_recurrent`): no module walk per pass
    return names


def runs_recurrent(model: torch.nn.Module) -> bool:
    """Whether `prepare_recurrent` wrapped recurrent mixers of `model` (the transformers model it was given)."""
    return bool(getattr(model, "_prefixdpo_runs_recurrent", False))


__all__ = ["Run", "RunStates", "SpanWalk", "SUPPORTED_MIXERS", "UNSUPPORTED_MIXERS", "prepare_recurrent",
           "supported_mixers", "unsupported_mixers", "walk_spans"]
