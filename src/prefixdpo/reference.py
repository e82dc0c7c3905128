"""Reference log-probs: from a frozen model, from the PEFT policy with its adapter off, or precomputed.

Modes (chosen by the trainer):

- ``model``:       a separate frozen reference model, one no-grad prefix-shared pass per micro-batch;
- ``adapter``:     the LoRA policy with its adapter disabled (no second copy of the weights);
- ``precomputed``: one prefix-shared no-grad pass over the dataset before training, cached on disk
                   under a key of (model config + weights fingerprint, data fingerprint, settings), so a
                   re-run with the same model, data and settings loads it instead of recomputing;
- ``none``:        reference-free losses (SimPO, ORPO, SFT) load and run no reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo.forward import compute_response_logps, unwrap

REFERENCE_MODES = ("model", "adapter", "precomputed", "none")
CACHE_VERSION = "prefixdpo-ref-logps-v1"


@dataclass
class RefLogpsTable:
    """Reference log-prob sums of every response of a dataset.

    sums:    [total responses] fp32, responses in example order
    offsets: [N + 1] long; example i's responses are sums[offsets[i]:offsets[i+1]]
    """

    sums: torch.Tensor
    offsets: torch.Tensor

    def gather(self, example_ids: torch.Tensor) -> torch.Tensor:
        """Sums of the responses of `example_ids` [E], concatenated in that order (a Batch's order) -> [R]."""
        parts = [self.sums[self.offsets[e] : self.offsets[e + 1]] for e in example_ids.tolist()]
        return torch.cat(parts) if parts else self.sums.new_zeros(0)

    def __len__(self) -> int:
        return int(self.offsets.numel() - 1)


@contextlib.contextmanager
def adapter_disabled(model):
    """Run the PEFT `model` (possibly DDP-wrapped) as its base model, adapter off."""
    peft_model = unwrap(model)
    with peft_model.disable_adapter():
        yield model


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(unwrap(model), PeftModel)


def reference_sums(model, batch, *, adapter: bool = False, backend: str = "auto", chunk_size: int = 1024,
                   attention_mask=None) -> torch.Tensor:
    """No-grad per-response log-prob sums [R] of `batch` under the reference (`model`, adapter off if asked)."""
    ctx = adapter_disabled(model) if adapter else contextlib.nullcontext()
    was_training = unwrap(model).training
    with torch.no_grad(), ctx:
        if adapter:
            # dropout off for the reference pass, as TRL's reference is in eval mode
            unwrap(model).eval()
        try:
            return compute_response_logps(
                model, batch, backend=backend, chunk_size=chunk_size, attention_mask=attention_mask
            ).sums.detach()
        finally:
            if adapter and was_training:
                unwrap(model).train()


# ---------------------------------------------------------------------------------------------
# Fingerprints and the on-disk cache
# ---------------------------------------------------------------------------------------------

_SAMPLE = 1 << 20  # elements hashed per tensor at most (a strided sample of bigger tensors)


def weights_fingerprint(model, *, skip_adapter: bool = False) -> str:
    """sha256 of parameter names, shapes, dtypes and values (a strided sample of big tensors).

    skip_adapter: leave out LoRA parameters (the reference is the base model with the adapter off).
    """
    h = hashlib.sha256()
    for name, p in unwrap(model).named_parameters():
        if skip_adapter and "lora_" in name:
            continue
        t = p.detach().flatten()
        step = max(1, t.numel() // _SAMPLE)
        sample = t[::step].contiguous().cpu()
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def config_fingerprint(model) -> str:
    hf = unwrap(model)
    base = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    cfg = base.config.to_dict()
    for volatile in ("_attn_implementation", "_attn_implementation_internal", "transformers_version", "_name_or_path"):
        cfg.pop(volatile, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()


def data_fingerprint(examples: Sequence[Example]) -> str:
    """sha256 of every example's prompt, responses and pairs (order matters: the table is by index)."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(repr((ex.prompt_ids, ex.response_ids, ex.pairs)).encode())
    return h.hexdigest()


def cache_key(model, examples: Sequence[Example], settings: dict, *, skip_adapter: bool = False) -> str:
    parts = {
        "version": CACHE_VERSION,
        "config": config_fingerprint(model),
        "weights": weights_fingerprint(model, skip_adapter=skip_adapter),
        "data": data_fingerprint(examples),
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _dist():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def compute_table(
    model, examples: Sequence[Example], *, adapter: bool = False, batch_size: int = 8, backend: str = "auto",
    chunk_size: int = 1024, pad_token_id: int = 0, device=None,
) -> RefLogpsTable:
    """One no-grad prefix-shared pass over `examples` (sharded over ranks, then gathered)."""
    rank, world = _dist()
    device = device or next(unwrap(model).parameters()).device
    mine = list(range(rank, len(examples), world))
    mine.sort(key=lambda i: examples[i].shared_length)  # similar lengths together: less padding
    results: dict[int, list[float]] = {}
    for start in range(0, len(mine), batch_size):
        ids = mine[start : start + batch_size]
        batch = build_batch([examples[i] for i in ids], prefix_sharing=True, pad_token_id=pad_token_id).to(device)
        sums = reference_sums(model, batch, adapter=adapter, backend=backend, chunk_size=chunk_size).float().cpu()
        offset = 0
        for i in ids:
            k = examples[i].num_responses
            results[i] = sums[offset : offset + k].tolist()
            offset += k
    if world > 1:
        gathered: list = [None] * world
        torch.distributed.all_gather_object(gathered, results)
        results = {i: v for part in gathered for i, v in part.items()}
    flat = [v for i in range(len(examples)) for v in results[i]]
    offsets = [0]
    for ex in examples:
        offsets.append(offsets[-1] + ex.num_responses)
    return RefLogpsTable(torch.tensor(flat, dtype=torch.float32), torch.tensor(offsets, dtype=torch.long))


def load_or_compute_table(
    model, examples: Sequence[Example], cache_dir: str, *, adapter: bool = False, settings: dict | None = None,
    **kwargs,
) -> tuple[RefLogpsTable, str, bool]:
    """The reference table from `cache_dir` if a file with this key exists, else computed and saved.

    Returns (table, path, loaded_from_cache).
    """
    from safetensors.torch import load_file, save_file

    settings = dict(settings or {})
    key = cache_key(model, examples, settings, skip_adapter=adapter)
    path = os.path.join(cache_dir, f"ref_logps_{key}.safetensors")
    if os.path.isfile(path):
        data = load_file(path)
        table = RefLogpsTable(data["sums"], data["offsets"])
        if len(table) == len(examples):
            return table, path, True
    table = compute_table(model, examples, adapter=adapter, **kwargs)
    rank, _ = _dist()
    if rank == 0:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        save_file({"sums": table.sums, "offsets": table.offsets}, tmp, metadata={"key": key})
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    return table, path, False
