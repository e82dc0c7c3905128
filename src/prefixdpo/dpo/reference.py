"""The reference model of DPO as one strategy with one interface.

Every strategy answers `logps(policy, batch, mask, item)`: the no-grad per-response log-prob sums [R] of
`batch` under the reference (None for reference-free losses). The trainer never asks which one it has.

- `SeparateModelReference`: a frozen model (a given one, or a copy of the policy at the start), one
  no-grad prefix-shared pass per micro-batch with the policy's mask; with `sync_ref_model` (TR-DPO) the
  only strategy whose reference moves: `mix_in` blends the policy into it (called by a callback);
- `AdapterReference`: the PEFT policy with its adapter disabled (no second copy of the weights);
- `PrecomputedReference`: tables of log-prob sums computed once per dataset by one of the two above and
  cached on disk. A table belongs to the *content* of a list of examples (a fingerprint), never to a
  Python object, and a dataset seen for the first time (e.g. `evaluate(new_data)` after training) gets
  its table from the same source: the policy is never a silent stand-in for the reference. The source
  model is parked on the CPU between uses, so precomputing still frees accelerator memory;
- `NoReference`: reference-free losses (SimPO, ORPO, SFT) load and run nothing.

The on-disk key covers the model config, every byte of every weight (gathered when sharded), the
examples' content and the settings. A cache file is used only if it proves its content: its cache version,
its stored key, the sha256 of its payload, offsets that step by each example's response count, and finite
values; anything else is recomputed with one warning line and the file rewritten (atomically). Rank 0
alone reads and writes the cache, and its table reaches every rank: see `load_or_compute_table`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from prefixdpo.atomic_io import atomic_path
from prefixdpo.core.attention.backends import build_attention_mask, resolve_backend
from prefixdpo.data.batch import Batch, build_batch
from prefixdpo.data.example import Example
from prefixdpo.errors import ConfigError
from prefixdpo.core.model_checks import base_model, unwrap
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.rank_decisions import from_rank0, gather, rank_and_world

logger = logging.getLogger(__name__)

CACHE_VERSION = "prefixdpo-ref-logps-v3"  # v3: the payload's sha256 and the version in the file's metadata


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(unwrap(model), PeftModel)


@contextlib.contextmanager
def _as_reference(model, adapter_off: bool):
    """No grad, eval mode (dropout off, as TRL's reference), and the PEFT adapter off if asked."""
    inner = unwrap(model)
    was_training = inner.training
    ctx = inner.disable_adapter() if adapter_off else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        inner.eval()
        try:
            yield model
        finally:
            inner.train(was_training)


def reference_response_logps(model, batch: Batch, attention_mask, *, adapter_off: bool = False,
                             chunk_size: int = 1024):
    """No-grad `ResponseLogps` of `batch` under `model` (its adapter off if asked): sums [R], per-token [T]."""
    with _as_reference(model, adapter_off):
        return compute_response_logps(model, batch, attention_mask, chunk_size=chunk_size)


def reference_sums(model, batch: Batch, attention_mask, **kwargs) -> torch.Tensor:
    """No-grad per-response log-prob sums [R] of `batch` (see `reference_response_logps`)."""
    return reference_response_logps(model, batch, attention_mask, **kwargs).sums.detach()


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


class NoReference:
    """Reference-free losses: nothing is loaded or run."""

    name = "none"

    def logps(self, policy, batch, mask, item=None):
        return None


class SeparateModelReference:
    """A separate frozen model, run with the policy's mask (one mask per micro-batch serves both)."""

    name = "model"

    def __init__(self, model, *, chunk_size: int = 1024, backend: str = "auto"):
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.chunk_size = chunk_size
        self.backend = backend

    def response_logps(self, policy, batch, mask):
        """Sums and per-token log-probs (LD-DPO needs the tokens), no grad."""
        return reference_response_logps(self.model, batch, mask, chunk_size=self.chunk_size)

    def logps(self, policy, batch, mask, item=None) -> torch.Tensor:
        return self.response_logps(policy, batch, mask).sums.detach()

    def check_mixable(self, policy) -> None:
        """ConfigError unless the reference holds the policy's parameters (same names and shapes, same
        order), which `mix_in` pairs by position as TRL does."""
        ours = [(n, tuple(p.shape)) for n, p in unwrap(self.model).named_parameters()]
        theirs = [(n, tuple(p.shape)) for n, p in unwrap(policy).named_parameters()]
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            ref_p = ours[first] if first < len(ours) else "nothing"
            pol_p = theirs[first] if first < len(theirs) else "nothing"
            raise ConfigError(
                f"sync_ref_model=True: ref_model's parameters differ from the policy's (parameter {first}: "
                f"reference {ref_p}, policy {pol_p}); the reference can only be mixed with a policy of its shape"
            )

    def mix_in(self, policy, alpha: float) -> None:
        """TR-DPO's reference update (https://huggingface.co/papers/2404.09656), as TRL's
        `SyncRefModelCallback`: every parameter, in place, ``ref = (1 - alpha) * ref + alpha * policy``
        (the same two ops in the same order as TRL, so the result is bit for bit TRL's). Buffers are
        left alone, as in TRL.

        Under FSDP2 the reference is sharded like the policy (`engines.prepare_reference_for_engine`): each
        rank updates its own shard. Under DDP and ZeRO-1/2 both are whole on every rank. (ZeRO-3 with TR-DPO
        is refused: `engines.refuse_unsupported_engine_options`.)
        """
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for ref_p, pol_p in zip(unwrap(self.model).parameters(), unwrap(policy).parameters(), strict=True):
                pol = pol_p.detach()
                if isinstance(ref_p, DTensor):  # the policy's shard laid out as the reference's
                    pol = pol.redistribute(ref_p.device_mesh, ref_p.placements)
                ref_p.mul_(1.0 - alpha).add_(pol, alpha=alpha)


class AdapterReference:
    """The PEFT policy with its adapter disabled: the base model the adapter started from."""

    name = "adapter"

    def __init__(self, *, chunk_size: int = 1024, backend: str = "auto"):
        self.chunk_size = chunk_size
        self.backend = backend

    def response_logps(self, policy, batch, mask):
        """Sums and per-token log-probs (LD-DPO needs the tokens), no grad."""
        return reference_response_logps(policy, batch, mask, adapter_off=True, chunk_size=self.chunk_size)

    def logps(self, policy, batch, mask, item=None) -> torch.Tensor:
        return self.response_logps(policy, batch, mask).sums.detach()


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


class PrecomputedReference:
    """Tables computed once per dataset (by content) from `source`, cached on disk under `cache_dir`.

    source: a SeparateModelReference (its model is parked on the CPU between tables) or an
            AdapterReference (the policy with its adapter off; needs `policy` at `table_for` time).
    The micro-batch carries its rows of the table as `item.ref_logps` (the loader gathers them).
    """

    name = "precomputed"

    def __init__(self, source, *, cache_dir: str, batch_size: int, pad_token_id: int, device):
        self.source = source
        self.cache_dir = cache_dir
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.device = device
        self.tables: dict[str, RefLogpsTable] = {}  # data fingerprint -> table
        self.cache_hits: dict[str, bool] = {}  # dataset name -> loaded from disk

    def logps(self, policy, batch, mask, item=None) -> torch.Tensor:
        return item.ref_logps.to(batch.input_ids.device)

    def table_for(self, examples: Sequence[Example], policy, name: str = "data") -> RefLogpsTable:
        """The table of `examples`: in memory by content, else from the disk cache, else computed."""
        key = data_fingerprint(examples)
        if key not in self.tables:
            self.tables[key] = self._load_or_compute(examples, policy, name)
        return self.tables[key]

    def _load_or_compute(self, examples, policy, name) -> RefLogpsTable:
        adapter_off = isinstance(self.source, AdapterReference)
        model = policy if adapter_off else self.source.model
        settings = {"dtype": str(next(unwrap(model).parameters()).dtype), "adapter_off": adapter_off}
        with _on_device(None if adapter_off else model, self.device):
            table, path, hit = load_or_compute_table(
                model, examples, self.cache_dir, adapter_off=adapter_off, settings=settings,
                batch_size=self.batch_size, chunk_size=self.source.chunk_size, backend=self.source.backend,
                pad_token_id=self.pad_token_id, device=self.device,
            )
        self.cache_hits[name] = hit
        logger.info("reference log-probs for %s %s %s", name, "loaded from" if hit else "computed and saved to", path)
        return table


@contextlib.contextmanager
def _on_device(model, device):
    """Bring a parked reference model to `device` for one table, then back to the CPU."""
    if model is None or torch.device(device).type == "cpu":
        yield
        return
    model.to(device)
    try:
        yield
    finally:
        model.to("cpu")


def choose_reference(*, needs_reference: bool, precompute: bool, ref_model, policy, chunk_size: int,
                     backend: str, cache_dir: str, batch_size: int, pad_token_id: int, device):
    """The strategy TRL users expect: none for reference-free losses; a given model; the policy's adapter
    off for PEFT; else a frozen copy of the starting policy (TRL's `create_reference_model`); precomputed
    wraps the chosen source."""
    from prefixdpo.core.engines_deepspeed import reference_copy

    if not needs_reference:
        return NoReference()
    if ref_model is not None:
        source = SeparateModelReference(ref_model, chunk_size=chunk_size, backend=backend)
    elif is_peft_model(policy):
        source = AdapterReference(chunk_size=chunk_size, backend=backend)
    else:
        source = SeparateModelReference(reference_copy(unwrap(policy)), chunk_size=chunk_size, backend=backend)
    if not precompute:
        return source
    if isinstance(source, SeparateModelReference):
        source.model.to("cpu")  # parked: used only to compute tables
    return PrecomputedReference(source, cache_dir=cache_dir, batch_size=batch_size, pad_token_id=pad_token_id,
                                device=device)


# ---------------------------------------------------------------------------------------------
# Fingerprints and the on-disk cache
# ---------------------------------------------------------------------------------------------


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


def cache_key(model, examples: Sequence[Example], settings: dict, *, skip_adapter: bool = False) -> str:
    parts = {
        "version": CACHE_VERSION,
        "config": config_fingerprint(model),
        "weights": weights_fingerprint(model, skip_adapter=skip_adapter),
        "data": data_fingerprint(examples),
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def compute_table(
    model, examples: Sequence[Example], *, adapter_off: bool = False, batch_size: int = 8, chunk_size: int = 1024,
    backend: str = "auto", pad_token_id: int = 0, device=None,
) -> RefLogpsTable:
    """One no-grad prefix-shared pass over `examples` (sharded over ranks, then gathered)."""
    rank, world = rank_and_world()
    device = device or next(unwrap(model).parameters()).device
    backend = resolve_backend(backend, device, needs_grad=False)
    mine = list(range(rank, len(examples), world))
    mine.sort(key=lambda i: examples[i].shared_length)  # similar lengths together: less padding
    results: dict[int, list[float]] = {}
    # every rank runs the same number of batches: a sharded (FSDP2 / ZeRO-3) model's forward is a collective
    batches = -(-(-(-len(examples) // world)) // batch_size)
    for start in range(0, batches * batch_size, batch_size):
        ids = mine[start : start + batch_size]
        run = ids or [0]  # a rank out of examples runs example 0 and keeps nothing
        batch = build_batch([examples[i] for i in run], prefix_sharing=True, pad_token_id=pad_token_id).to(device)
        mask = build_attention_mask(batch.doc_ids, batch.branch_ids, backend)  # one per batch of the table
        sums = reference_sums(model, batch, attention_mask=mask, adapter_off=adapter_off,
                              chunk_size=chunk_size).float().cpu()
        offset = 0
        for i in ids:
            k = examples[i].num_responses
            results[i] = sums[offset : offset + k].tolist()
            offset += k
    results = {i: v for part in gather(results) for i, v in part.items()}
    flat = [v for i in range(len(examples)) for v in results[i]]
    offsets = [0]
    for ex in examples:
        offsets.append(offsets[-1] + ex.num_responses)
    return RefLogpsTable(torch.tensor(flat, dtype=torch.float32), torch.tensor(offsets, dtype=torch.long))


def payload_checksum(table: RefLogpsTable) -> str:
    """sha256 of the table's bytes: sums [total responses] fp32, then offsets [N + 1] int64."""
    h = hashlib.sha256()
    for t in (table.sums, table.offsets):
        h.update(t.detach().contiguous().cpu().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def table_problem(table: RefLogpsTable, examples: Sequence[Example]) -> str | None:
    """Why `table` cannot be the table of `examples`, or None: sums must be a finite fp32 vector and offsets
    [N + 1] must start at 0 and step by each example's response count up to the length of sums."""
    sums, offsets = table.sums, table.offsets
    if sums.dtype != torch.float32 or sums.dim() != 1 or offsets.dtype != torch.long or offsets.dim() != 1:
        return f"sums {sums.dtype} {tuple(sums.shape)} / offsets {offsets.dtype} {tuple(offsets.shape)} are not " \
               "a float32 vector and an int64 vector"
    if offsets.numel() != len(examples) + 1:
        return f"offsets for {offsets.numel() - 1} examples, the data has {len(examples)}"
    if offsets.numel() == 0 or int(offsets[0]) != 0:
        return "offsets do not start at 0"
    counts = torch.tensor([ex.num_responses for ex in examples], dtype=torch.long)
    wrong = (offsets.diff() != counts).nonzero().flatten()
    if wrong.numel():
        i = int(wrong[0])
        return f"offsets give example {i} {int(offsets[i + 1] - offsets[i])} responses, it has {int(counts[i])}"
    if int(offsets[-1]) != sums.numel():
        return f"offsets end at {int(offsets[-1])}, sums hold {sums.numel()} values"
    bad = int((~torch.isfinite(sums)).sum())
    if bad:
        return f"{bad} of its {sums.numel()} values are not finite"
    return None


def read_cached_table(path: str, key: str, examples: Sequence[Example]) -> tuple[RefLogpsTable | None, str]:
    """(table, "") if the file at `path` proves it holds `key`'s table of `examples`, else (None, why not).

    A missing file is (None, "missing"). Proof: this cache version, this key, a payload whose sha256 is the
    stored one, and a table that fits the examples (`table_problem`).
    """
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
            names = sorted(fh.keys())
            if names != ["offsets", "sums"]:
                return None, f"it holds tensors {names}, not offsets and sums"
            table = RefLogpsTable(fh.get_tensor("sums"), fh.get_tensor("offsets"))
    except FileNotFoundError:
        return None, "missing"
    except Exception as exc:  # truncated or garbage bytes: whatever the reader raises, the file holds no table
        reason = (str(exc).strip().splitlines() or [""])[0]
        return None, f"unreadable ({type(exc).__name__}: {reason})"
    if meta.get("version") != CACHE_VERSION:
        return None, f"written by cache version {meta.get('version', 'v2 or older')}, this is {CACHE_VERSION}"
    if meta.get("key") != key:
        return None, "its stored key is another model's, data's or settings'"
    if meta.get("sha256") != payload_checksum(table):
        return None, "its payload does not match its checksum (edited or damaged)"
    problem = table_problem(table, examples)
    if problem is not None:
        return None, problem
    return table, ""


def cached_table(path: str, key: str, examples: Sequence[Example]) -> RefLogpsTable | None:
    """The proven table at `path`, or None; a file that is there but proves nothing is one warning line."""
    table, why = read_cached_table(path, key, examples)
    if table is None and why != "missing":
        logger.warning("reference cache %s not used, recomputing it: %s", path, why)
    return table


def write_table(path: str, table: RefLogpsTable, key: str) -> None:
    """Save `table` with its key, the cache version and its payload checksum, atomically. A failed write is
    one warning: the cache only saves time, and one rank must not stop while the others train on."""
    from safetensors.torch import save_file

    metadata = {"key": key, "version": CACHE_VERSION, "sha256": payload_checksum(table)}
    try:
        with atomic_path(path) as tmp:
            save_file({"sums": table.sums.contiguous(), "offsets": table.offsets.contiguous()}, tmp,
                      metadata=metadata)
    except OSError as exc:
        logger.warning("could not save reference cache %s (%s): the next run computes it again", path, exc)


def load_or_compute_table(
    model, examples: Sequence[Example], cache_dir: str, *, adapter_off: bool = False, settings: dict | None = None,
    **kwargs,
) -> tuple[RefLogpsTable, str, bool]:
    """The reference table of `examples` from `cache_dir` if the file of this key proves it holds it
    (`read_cached_table`), else computed and saved. Returns (table, path, loaded_from_cache).

    Ranks take one decision: rank 0 alone reads the cache, and its hit or miss, with the table on a hit,
    is broadcast, so other ranks never read their own disk (a per-node `~/.cache` may be empty or hold
    something else). On a miss every rank computes (`compute_table` shares the work out) and rank 0 alone
    writes: the only reader is the only writer, so ranks sharing the folder (one node's, or every node's
    on a shared home) never write the same file at once, and a copy elsewhere would never be read.
    """
    key = cache_key(model, examples, dict(settings or {}), skip_adapter=adapter_off)  # collective when sharded
    path = os.path.join(cache_dir, f"ref_logps_{key[:32]}.safetensors")
    rank, _ = rank_and_world()
    table = from_rank0(cached_table(path, key, examples) if rank == 0 else None)
    if table is not None:
        return table, path, True
    table = compute_table(model, examples, adapter_off=adapter_off, **kwargs)
    if rank == 0:
        write_table(path, table, key)
    return table, path, False
