"""The cached prefix store of prefix reuse (`core.prefix_reuse`): each layer's keys and values of a line's shared
prefix, recorded by the prefix's own pass and put before the keys and values of each later pass over its chunks."""

from __future__ import annotations

import torch

from prefixdpo.errors import ConfigError


class PrefixKV:
    """Per-layer keys and values of a cached prefix, reaching every attention call of a pass through its plan
    (`PassPlan.prefix_kv`), by the attention module's `layer_idx`. `record()`: the prefix's own pass, which keeps
    each layer's key/value [B, Hkv, p, D] (with their autograd graph); `prepended()`: a pass over tokens after the
    prefix, whose keys and values are the prefix's followed by its own. Through prefixdpo's attention rather than
    a transformers cache, so gradient checkpointing (which drops a layer's cache) keeps it.

    `states`: a hybrid's recurrent layers' final states at the prefix's end, by the mixer's `layer_idx`: ({state_idx:
    conv state [1, C, K]}, {state_idx: recurrent state}), recorded by the prefix's pass and the initial states of
    every run of a chunk that descends straight from the prefix (`core.recurrent.mixers`)."""

    def __init__(self, layers: dict | None = None, recording: bool = True, states: dict | None = None):
        self.layers = {} if layers is None else layers
        self.states = {} if states is None else states
        self.recording = recording

    def prepended(self) -> "PrefixKV":
        """A store that puts this one's keys and values before a later pass's own (a snapshot: a layer recomputed
        in backward may record again)."""
        return PrefixKV(dict(self.layers), recording=False, states=dict(self.states))

    def keys_values(self, module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value [B, Hkv, l, D] of `module`'s pass -> those the attention reads: the same (recording), or the
        prefix's [B, Hkv, p, D] followed by them."""
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ConfigError(f"prefix_reuse needs attention modules with a layer_idx; {type(module).__name__} has "
                              "none: set prefix_reuse false")
        if self.recording:
            self.layers[layer] = (key, value)
            return key, value
        cached_key, cached_value = self.layers[layer]
        return torch.cat([cached_key, key], dim=2), torch.cat([cached_value, value], dim=2)


__all__ = ["PrefixKV"]
