"""Fingerprints (sha256) of what a saved result depends on: every weight's bytes, the model's config, the data's
token ids. The reference cache keys its tables with them; a checkpoint records the run's, so a resume can tell a
foreign or changed run from its own."""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

import torch

from prefixdpo.core.model_checks import base_model, unwrap
from prefixdpo.data.example import Example


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded DTensor (FSDP2) is gathered first."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def weights_fingerprint(model, *, skip_adapter: bool = False) -> str:
    """sha256 of every parameter and buffer: names, shapes, dtypes and every byte of every element.

    skip_adapter: leave out LoRA parameters (the reference is the base model with the adapter off).
    """
    h = hashlib.sha256()
    inner = unwrap(model)
    for name, t in [*inner.named_parameters(), *inner.named_buffers()]:
        if skip_adapter and "lora_" in name:
            continue
        full = _full(t.detach()).contiguous().cpu()
        h.update(f"{name}|{tuple(full.shape)}|{full.dtype}|".encode())
        h.update(full.flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def config_fingerprint(model) -> str:
    cfg = base_model(model).config.to_dict()
    for volatile in ("_attn_implementation", "_attn_implementation_internal", "transformers_version", "_name_or_path"):
        cfg.pop(volatile, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()


def data_fingerprint(examples: Sequence[Example]) -> str:
    """sha256 of every example's prompt, responses and pairs (order matters: the table is by index)."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(repr((ex.prompt_ids, ex.response_ids, ex.pairs)).encode())
    return h.hexdigest()


def _value_digest(value) -> str:
    """A stable stand-in for a field JSON cannot write: the sha256 of its bytes (an image, an array), else its
    str (never a repr holding a memory address, which would differ in every process)."""
    if isinstance(value, (bytes, bytearray)):
        return hashlib.sha256(bytes(value)).hexdigest()
    if hasattr(value, "tobytes"):  # PIL images, numpy arrays
        return f"{type(value).__name__}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    return str(value)


def records_fingerprint(records, extra: Sequence[str] = ()) -> str:
    """sha256 of every record (a dict of fields: a prompt dataset's rows, in order) and of `extra` (names of what
    else defines the data, e.g. reward functions)."""
    h = hashlib.sha256()
    for name in extra:
        h.update(f"{name}\n".encode())
    for record in records:
        h.update(json.dumps(record, sort_keys=True, default=_value_digest).encode())
        h.update(b"\n")
    return h.hexdigest()
