"""`activation_offloading` as TRL 1.16 does it: the training forward runs inside TRL's
`OffloadActivations` context, which moves saved activations to (pinned) CPU memory during the forward
and brings them back for the backward, keeping the LM head's own activations on the device.

The context is built once per trainer (it registers hooks on the model's output head) and entered around
every training forward, as TRL's `DPOTrainer` does with `maybe_activation_offload_context`.
"""

from __future__ import annotations

import contextlib

import torch

from prefixdpo.errors import ConfigError


def activation_offloading_context(model: torch.nn.Module, enabled: bool):
    """TRL's activation-offloading context manager for `model` when `enabled`, else a `nullcontext`.

    Raises `ConfigError` (one line) when enabled with the model on the CPU: TRL's offloader moves
    activations from an accelerator to CPU memory through the accelerator's streams, so on the CPU it has
    nowhere to move them (and fails building its stream).
    """
    if not enabled:
        return contextlib.nullcontext()
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if device.type == "cpu" or accelerator is None:
        raise ConfigError(f"activation_offloading moves activations from an accelerator to CPU memory; the model is "
                          f"on {device.type}{'' if accelerator else ' and no accelerator is present'}: turn it off")
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    return get_act_offloading_ctx_manager(model=model)
