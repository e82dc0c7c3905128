"""`RunStates`: the cache a recurrent mixer reads its initial states from and writes its final states to, for one
call over one batch of runs, out of place so the autograd graph runs through the states.

Every recurrent mixer of transformers 5.25 (Gated DeltaNet, Kimi Delta Attention, LFM short convolutions, Mamba2)
talks to its cache through the same few methods of `cache_utils.Cache` for linear-attention layers:
`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`, `is_recording_past`,
`get_recurrent_states_to_keep`, `increase_count`. This object answers exactly those for one layer, so the mixer runs
its own code path (its convolution over `[conv state | inputs]`, its chunked rule with `initial_state=`) from the
states we hand it.

Why not transformers' own `DynamicCache` with `LinearAttentionLayer`s (measured in transformers 5.25's source):
- `LinearAttentionLayer.update_conv_state` / `update_recurrent_state` write with `copy_` into buffers created by
  `torch.zeros` (kept at a static address for CUDA graphs). autograd records the copy, so a single chain keeps its
  graph (measured: LFM2's and NemotronH's input gradients through a DynamicCache equal one whole pass's), but the
  new state is the *same tensor* the mixer read its initial state from: Qwen3.5's chunked rule saves that buffer for
  its backward, and backward raises "modified by an inplace operation" (measured); and a parent read by two
  children would have its state overwritten by the first child's before the second reads it;
- a one-token call with a conv state takes the decode path `causal_conv1d_update`, which `copy_`s into the conv
  state it was handed, unless the cache says it records the past (`is_recording_past`);
- `get_*_state` answers None until `has_previous_state`, which only an earlier update sets.
So this cache says it records the past (the mixers then always run the multi-token path: the convolution over the
concatenated inputs, no in-place update), keeps no history (`get_recurrent_states_to_keep` 0), returns the states it
was given, and stores the mixer's final states by assignment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RunStates:
    """The initial and final states of one mixer call over a batch of runs [n, length, ...] (one layer).

    conv:      {state_idx: [n, channels, kernel]} the inputs of the last `kernel` columns before the runs (None: a
               root batch, the zero state); after the call, those of the runs' own last columns
    recurrent: {state_idx: tensor} the recurrent state before the runs (None: zero); after the call, the final one
    """

    def __init__(self, layer_idx: int, conv: dict[int, torch.Tensor] | None = None,
                 recurrent: dict[int, torch.Tensor] | None = None):
        self.layer_idx = layer_idx
        self.conv: dict[int, torch.Tensor | None] = dict(conv or {})
        self.recurrent: dict[int, torch.Tensor | None] = dict(recurrent or {})

    def _check(self, layer_idx: int) -> None:
        if layer_idx != self.layer_idx:  # one object per layer call: a mismatch is a mixer reading another layer
            raise RuntimeError(f"recurrent states of layer {self.layer_idx} asked for layer {layer_idx}")

    # -- the reads
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._check(layer_idx)
        return self.conv.get(state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._check(layer_idx)
        return self.recurrent.get(state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # keeps every mixer off its in-place one-token decode path (module docstring)

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return any(v is not None for v in (*self.conv.values(), *self.recurrent.values()))

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        pass  # a token count is kept for generation's positions; a pass over runs has none

    # -- the writes, by assignment
    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """conv_states: the call's inputs [n, channels, length] -> [state | inputs], what the convolution runs over
        (the mixer drops the outputs of the state's columns); keeps the last `conv_kernel_size` columns as the final
        state (zero-padded on the left when the runs and their state are shorter)."""
        self._check(layer_idx)
        kernel = conv_kernel_size if conv_kernel_size is not None else conv_states.shape[-1]
        previous = self.conv.get(state_idx)
        full = conv_states if previous is None else torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        last = full[..., -kernel:]
        if last.shape[-1] < kernel:
            last = F.pad(last, (kernel - last.shape[-1], 0))
        self.conv[state_idx] = last
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._check(layer_idx)
        if not isinstance(recurrent_states, torch.Tensor):  # a list of per-token states: the last is the final one
            recurrent_states = recurrent_states[-1]
        self.recurrent[state_idx] = recurrent_states
        return recurrent_states
