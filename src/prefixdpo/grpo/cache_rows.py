"""The shared prefill's cache, handed from its U unique prompt rows to the N decoding rows (`generation.py`).

A transformers 5.25 `DynamicCache` holds one layer object per decoder layer; the prefill fills them for U rows and
each is expanded to N rows by index (row i gets its prompt's row) before `generate` continues:
- per-token keys and values (`DynamicLayer`, `DynamicSlidingWindowLayer`): `batch_select_indices`, transformers' own;
- a recurrent layer's state (`LinearAttentionLayer`: Gated DeltaNet, Kimi Delta Attention and Mamba2 conv and SSM
  states, LFM2's short-convolution window; `LinearAttentionAndFullAttentionLayer`, Falcon-H1's Mamba2 beside
  attention in one layer, and its sliding-window twin): `reorder_cache`, transformers' own beam-search reorder, an
  `index_select` of every initialized conv and recurrent state (and of a hybrid layer's keys and values). Their
  `batch_select_indices` would not do: `LinearAttentionLayer` has none, and the hybrid layers inherit
  `DynamicLayer`'s, which leaves the recurrent states at U rows. The flags the mixers read stay as the prefill left
  them: `has_previous_state` (per state: the next call is a continuation, so a one-token step takes the recurrent /
  conv-update path) and the token count `cumulative_length_linear` (the past length `generate` reads when layer 0
  is recurrent). Each row gets its own copy: the states diverge at the first decoded token (the saving is the
  prefill's compute, not the states' memory);
- `DummyLayer` (a layer without cache: NemotronH's MLP and MoE layers): nothing.

Any other layer type (quantized, static, offloaded, indexed) is not expanded: `unexpandable_layers` names it and the
caller runs transformers' own generate instead.

A cache of these layers is not enough: the model's recurrent mixers must keep their state in it and continue from it
as they continue in a longer call. `unshared_mixers` names those that do not, or are untested: the prefill then
leaves the last prompt column to the first decoding step, so a mixer that reads the 2D padding mask itself (Mamba 1:
transformers' `MambaForCausalLM` hands it `generate`'s whole [N, P] mask at that step, which it multiplies a one-column
input by) or keeps its state on the module (RecurrentGemma) would decode from something else.
"""

from __future__ import annotations

import torch
from transformers import cache_utils
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from prefixdpo.core.recurrent import SUPPORTED_MIXERS, UNSUPPORTED_MIXERS, state_api_supported


def _layer_types(*names: str) -> tuple[type, ...]:
    """The classes of `cache_utils` named, those this transformers has (the linear-attention ones came with 5.25's
    cache API; an older transformers' hybrids are refused by `unshared_mixers`)."""
    return tuple(getattr(cache_utils, n) for n in names if hasattr(cache_utils, n))


# exact types (a subclass may hold more than its base's method copies)
KEY_VALUE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
RECURRENT_LAYERS = _layer_types("LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer",
                                "LinearAttentionAndSlidingWindowAttentionLayer")
EXPANDABLE_LAYERS = (*KEY_VALUE_LAYERS, *RECURRENT_LAYERS, *_layer_types("DummyLayer"))
_STATE_MIXIN = _layer_types("LinearAttentionCacheLayerMixin")


def unexpandable_layers(layers) -> list[str]:
    """The sorted names of the layer types in `layers` that `expand_layer` does not hand to N rows."""
    return sorted({type(layer).__name__ for layer in layers if type(layer) not in EXPANDABLE_LAYERS})


def has_recurrent_state(layers) -> bool:
    """Whether any of `layers` carries a recurrent (conv or SSM) state."""
    return bool(_STATE_MIXIN) and any(isinstance(layer, _STATE_MIXIN) for layer in layers)


def expand_layer(layer, row_to_unique: torch.Tensor) -> None:
    """Expand one filled layer in place from U rows to N: row i <- row row_to_unique[i] (row_to_unique: [N] long)."""
    if _STATE_MIXIN and isinstance(layer, _STATE_MIXIN):
        layer.reorder_cache(row_to_unique)  # every state (and a hybrid layer's keys/values); flags kept
    else:
        layer.batch_select_indices(row_to_unique)


# recurrent mixers whose shared prefill is tested equal to plain generation (tests/test_hybrid_generation.py, a tiny
# model of each family in `prefixdpo_tools.hybrid_models`): every mixer prefix sharing runs (`core.recurrent`) but
# Zamba2's (`_MIXER_REASONS`), and Jamba's Mamba 1, which reads the mask cut to its columns
# (`create_recurrent_attention_mask`)
PREFILL_MIXERS = frozenset([*SUPPORTED_MIXERS, "JambaMambaMixer"]) - {"Zamba2MambaMixer"}
_MIXER_REASONS = {
    # measured: its shared prefill's first logits 1.6e-5 off plain generate's in float64 (no float32 cast left);
    # with the clamp lifted from the chunked scan, 4.2 eps64 x the dot scale
    "Zamba2MambaMixer": "clamps its time step at time_step_min in its chunked scan but not in its one-token step, so "
                        "the prompt's last column, which the shared prefill runs as a step, would differ from "
                        "generate's prefill",
    "MambaMixer": "multiplies its input by generate's whole 2D padding mask at a one-column step after a prefilled "
                  "cache (its model does not cut the mask)",
    "FalconMambaMixer": "multiplies its input by generate's whole 2D padding mask at a one-column step after a "
                        "prefilled cache (its model does not cut the mask)",
    "RecurrentGemmaRecurrentBlock": "keeps its convolution and RG-LRU states on the module, not in the cache",
}


def unshared_mixers(model: torch.nn.Module, layers) -> dict[str, str]:
    """{recurrent mixer class name: why} for the mixers of `model` whose states the shared prefill cannot hand on
    (module doc), given its cache's `layers`; {"": why} where the cache holds recurrent states but no mixer of `model`
    is one prefixdpo knows; {} for a model without either."""
    known = SUPPORTED_MIXERS.keys() | UNSUPPORTED_MIXERS.keys() | _MIXER_REASONS.keys()
    mixers = {type(m).__name__ for m in model.modules() if type(m).__name__ in known}
    if not mixers:
        return {"": "its recurrent layers are of no type prefixdpo knows"} if has_recurrent_state(layers) else {}
    if not state_api_supported():
        import transformers

        why = f"transformers {transformers.__version__} hands its states through another cache API than 5.25's"
        return dict.fromkeys(sorted(mixers), why)
    return {name: _MIXER_REASONS.get(name, "has no test of the shared prefill against plain generation yet")
            for name in sorted(mixers - PREFILL_MIXERS)}
