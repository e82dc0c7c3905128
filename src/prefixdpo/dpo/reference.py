"""The reference model of DPO as one strategy with one interface, built in one place (`build_reference`).

The trainer, the step and the benchmark only call `Reference` methods; none asks which strategy it holds:

- `sums(policy, batch, mask, item)`: no-grad per-response log-prob sums [R] (None: no reference), the rows
  the micro-batch carries when it has them (a precomputed table's; the step passes its pre-pass's own);
- `token_logps(policy, batch, mask)`: sums [R] and per-token [T] log-probs for LD-DPO, or a one-line
  refusal where the strategy holds sums only;
- `prepare_for_engine(accelerator)`, `precompute_tables(datasets, policy)`, `table_for(examples, policy,
  name)` (the rows the loader puts in each micro-batch), `sync_target()` (what TR-DPO moves), `model`
  (TRL's `ref_model`), `callbacks` (TR-DPO's sync, set by the builder).

The strategies:

- `SeparateModelReference`: a frozen model (a given one, or a copy of the policy at the start), one no-grad
  prefix-shared pass per micro-batch with the policy's mask; the only strategy whose reference moves
  (TR-DPO: `mix_in`, called by `tr_dpo.SyncReferenceCallback`);
- `AdapterReference`: the PEFT policy with its adapter disabled (no second copy of the weights);
- `PrecomputedReference`: tables of log-prob sums computed once per dataset by one of the two above and
  cached on disk (`reference_cache.py`). A dataset seen for the first time (e.g. `evaluate(new_data)` after
  training) gets its table from the same source: the policy is never a silent stand-in for the reference.
  The source model is parked on the CPU between uses, so precomputing still frees accelerator memory;
- `NoReference`: reference-free losses (SimPO, ORPO, SFT) run nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Sequence

import torch

from prefixdpo.core.attention.backends import resolve_backend
from prefixdpo.core.stock_attention import STOCK, plan_run_pass
from prefixdpo.core.engines import prepare_reference_for_engine
from prefixdpo.core.engines_deepspeed import reference_copy
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.logprobs import ResponseLogps
from prefixdpo.core.model_checks import unwrap
from prefixdpo.data.batch import Batch
from prefixdpo.data.example import Example
from prefixdpo.dpo.losses import LossConfigError
from prefixdpo.core.fingerprints import data_fingerprint
from prefixdpo.dpo.reference_cache import RefLogpsTable, load_or_compute_table
from prefixdpo.dpo.tr_dpo import tr_dpo_callback
from prefixdpo.errors import ConfigError
from prefixdpo.training.model_setup import is_peft_model, prepare_reference

logger = logging.getLogger(__name__)


def carried_sums(item) -> torch.Tensor | None:
    """The reference sums [R] a micro-batch carries (a precomputed table's rows), or None. The one place that
    reads them from the loader's `MicroBatch`."""
    return None if item is None else item.ref_logps


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
                             chunk_size: int = 1024) -> ResponseLogps:
    """No-grad `ResponseLogps` of `batch` under `model` (its adapter off if asked): sums [R], per-token [T]."""
    with _as_reference(model, adapter_off):
        return compute_response_logps(model, batch, attention_mask, chunk_size=chunk_size)


# ---------------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------------


class Reference:
    """What DPO asks of its reference. A strategy implements `response_logps`; every other method has the
    answer of a reference that holds nothing beyond it (no engine to prepare, no tables, cannot move)."""

    name = "custom"
    model = None  # TRL's `ref_model`: the separate model run every step, else None
    callbacks: tuple = ()  # trainer callbacks the reference needs (TR-DPO's sync), set by `build_reference`
    tokens_per_pass: int | None = None  # prefix reuse's budget for the passes it builds its own masks for

    def use_tokens_per_pass(self, budget: int | None) -> None:
        """Run the passes it builds masks for (tables) with prefix reuse over `budget` tokens (None: one pass)."""
        self.tokens_per_pass = budget

    def response_logps(self, policy, batch: Batch, mask) -> ResponseLogps | None:
        """No-grad sums [R] and per-token [T] log-probs of `batch`'s responses under the reference, with the
        policy's attention `mask` (None: built from the batch); None for a reference-free run."""
        raise NotImplementedError(f"{type(self).__name__} must implement response_logps")

    def sums(self, policy, batch: Batch, mask, item=None) -> torch.Tensor | None:
        """No-grad per-response sums [R] on `batch`'s device: those `item` carries, else `response_logps`'."""
        carried = carried_sums(item)
        if carried is not None:
            return carried.to(batch.input_ids.device)
        logps = self.response_logps(policy, batch, mask)
        return None if logps is None else logps.sums.detach()

    def token_logps(self, policy, batch: Batch, mask) -> ResponseLogps | None:
        """LD-DPO's per-token log-probs (no grad), or None without a reference."""
        return self.response_logps(policy, batch, mask)

    def idle_pass(self, policy, batch: Batch, mask) -> None:
        """What a rank-balancing empty micro-batch (no pairs) runs of the reference while other ranks' micro-batches
        run `sums`: a reference that runs a model pass joins collectives (the policy's engine with its adapter off,
        a sharded reference model, DDP's buffer broadcast), so it runs that pass too. Nothing here: no pass."""

    def prepare_for_engine(self, accelerator) -> None:
        """Make the reference ready for the policy's engine (FSDP2, DeepSpeed, a device): nothing to do here."""

    def precompute_tables(self, datasets: Iterable[tuple[str, Sequence[Example] | None]], policy) -> None:
        """Before training: the tables of every (name, examples) of the run. No tables here."""

    def table_for(self, examples: Sequence[Example], policy, name: str = "data") -> RefLogpsTable | None:
        """The table whose rows the loader puts into each micro-batch of `examples`, or None."""
        return None

    def sync_target(self) -> Reference | None:
        """TR-DPO: the strategy whose model moves towards the policy (`check_mixable`, `mix_in`); None where
        there is no reference (nothing to sync). A ConfigError where the reference cannot move."""
        raise ConfigError(f"sync_ref_model=True needs a separate reference model to update; the {self.name} "
                          "reference has none")


class NoReference(Reference):
    """Reference-free losses: nothing is loaded or run."""

    name = "none"

    def response_logps(self, policy, batch, mask) -> None:
        return None

    def sync_target(self) -> None:
        return None


class ModelPassReference(Reference):
    """A strategy that runs a no-grad prefix-shared pass of a model, and can be the source of tables."""

    adapter_off = False  # the pass is the policy with its PEFT adapter off (its LoRA weights not in the key)

    def __init__(self, *, chunk_size: int = 1024, backend: str = "auto"):
        self.chunk_size = chunk_size
        self.backend = backend

    def weights(self, policy):
        """The model whose pass this is."""
        raise NotImplementedError

    def response_logps(self, policy, batch, mask) -> ResponseLogps:
        return reference_response_logps(self.weights(policy), batch, mask, adapter_off=self.adapter_off,
                                        chunk_size=self.chunk_size)

    def idle_pass(self, policy, batch, mask) -> None:
        self.response_logps(policy, batch, mask)  # its result weighs nothing: only its collectives count

    def _mask(self, batch: Batch):
        """A table batch's mask (one per batch, no grad)."""
        backend = self.backend if self.backend == STOCK else resolve_backend(self.backend, batch.input_ids.device,
                                                                             needs_grad=False)
        return plan_run_pass(batch, backend, max_tokens_per_pass=self.tokens_per_pass)

    def park(self) -> None:
        """Used only for tables from now on: free the accelerator between them (nothing to move here)."""

    @contextlib.contextmanager
    def lent_to(self, device):
        """Within: the weights on `device` (they already are here)."""
        yield

    def table(self, examples: Sequence[Example], policy, *, cache_dir: str, batch_size: int, pad_token_id: int,
              device) -> tuple[RefLogpsTable, str, bool]:
        """(table, path, loaded from the cache) of `examples` under this pass (`load_or_compute_table`)."""
        model = self.weights(policy)
        settings = {"dtype": str(next(unwrap(model).parameters()).dtype), "adapter_off": self.adapter_off}
        with self.lent_to(device):
            return load_or_compute_table(
                model, examples, cache_dir, sums_of=lambda batch: self.sums(policy, batch, self._mask(batch)),
                skip_adapter=self.adapter_off, settings=settings, batch_size=batch_size, pad_token_id=pad_token_id,
                device=device, prefix_sharing=self.backend != STOCK,  # the model's own attention: unshared rows
            )


class SeparateModelReference(ModelPassReference):
    """A separate frozen model, run with the policy's mask (one mask per micro-batch serves both)."""

    name = "model"

    def __init__(self, model, *, chunk_size: int = 1024, backend: str = "auto"):
        super().__init__(chunk_size=chunk_size, backend=backend)
        model.eval()
        model.requires_grad_(False)
        self.model = model

    def weights(self, policy):
        return self.model

    def prepare_for_engine(self, accelerator) -> None:
        """Sharded like the policy under FSDP2, a ZeRO inference engine under DeepSpeed, else on the device
        (`engines.prepare_reference_for_engine`)."""
        self.model = prepare_reference_for_engine(self.model, accelerator)

    def park(self) -> None:
        self.model.to("cpu")

    @contextlib.contextmanager
    def lent_to(self, device):
        """Bring the parked model to `device` for one table, then back to the CPU."""
        if torch.device(device).type == "cpu":
            yield
            return
        self.model.to(device)
        try:
            yield
        finally:
            self.model.to("cpu")

    def sync_target(self) -> SeparateModelReference:
        return self

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

        Under FSDP2 the reference is sharded like the policy (`prepare_for_engine`): each rank updates its
        own shard. Under DDP and ZeRO-1/2 both are whole on every rank. (ZeRO-3 with TR-DPO is refused:
        `engines.refuse_unsupported_engine_options`.)
        """
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for ref_p, pol_p in zip(unwrap(self.model).parameters(), unwrap(policy).parameters(), strict=True):
                pol = pol_p.detach()
                if isinstance(ref_p, DTensor):  # the policy's shard laid out as the reference's
                    pol = pol.redistribute(ref_p.device_mesh, ref_p.placements)
                ref_p.mul_(1.0 - alpha).add_(pol, alpha=alpha)


class AdapterReference(ModelPassReference):
    """The PEFT policy with its adapter disabled: the base model the adapter started from."""

    name = "adapter"
    adapter_off = True

    def weights(self, policy):
        return policy


class IdleReference(Reference):
    """`reference` as a rank-balancing empty micro-batch asks it, on its stand-in line (`loader.stand_in_batch`): each
    question runs the pass the real strategy would run (`idle_pass`: the model pass of a `ModelPassReference`,
    nothing for a table or no reference) and answers zeros, which weigh nothing. So the step's code runs on an
    empty micro-batch exactly as on a real one (the pre-pass's `sums` first, then the training pass without
    the reference, say), and every rank joins the same collectives in the same order."""

    def __init__(self, reference: Reference):
        self.reference = reference
        self.name = f"idle {reference.name}"

    def response_logps(self, policy, batch, mask) -> None:
        self.reference.idle_pass(policy, batch, mask)
        return None

    def sums(self, policy, batch, mask, item=None) -> torch.Tensor:
        """[R] zeros on `batch`'s device (never None: a step that has the reference's sums runs no second pass)."""
        self.reference.idle_pass(policy, batch, mask)
        return torch.zeros(batch.num_responses, device=batch.input_ids.device)


class PrecomputedReference(Reference):
    """Tables computed once per dataset (by content) from `source`, cached on disk under `cache_dir`.

    source: a SeparateModelReference (its model is parked on the CPU between tables) or an
            AdapterReference (the policy with its adapter off); any `ModelPassReference`.
    The micro-batch carries its rows of the table (the loader gathers them from `table_for`).
    """

    name = "precomputed"

    def __init__(self, source: ModelPassReference, *, cache_dir: str, batch_size: int, pad_token_id: int, device):
        source.park()
        self.source = source
        self.cache_dir = cache_dir
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.device = device
        self.tables: dict[str, RefLogpsTable] = {}  # data fingerprint -> table
        self.cache_hits: dict[str, bool] = {}  # dataset name -> loaded from disk

    def response_logps(self, policy, batch, mask):
        raise RuntimeError("a precomputed reference reads its sums from the micro-batch, and this one carries "
                           "none: build its loader with the table (`table_for`)")

    def token_logps(self, policy, batch, mask):
        raise LossConfigError(
            "ld_alpha needs the reference's per-token log-probs, but precomputed reference tables hold "
            "per-response sums: set precompute_ref_log_probs=False to use ld_alpha"
        )

    def use_tokens_per_pass(self, budget: int | None) -> None:
        self.tokens_per_pass = budget
        self.source.use_tokens_per_pass(budget)

    def precompute_tables(self, datasets, policy) -> None:
        for name, examples in datasets:
            if examples is not None:
                self.table_for(examples, policy, name)

    def table_for(self, examples: Sequence[Example], policy, name: str = "data") -> RefLogpsTable:
        """The table of `examples`: in memory by content, else from the disk cache, else computed."""
        key = data_fingerprint(examples)
        if key not in self.tables:
            table, path, hit = self.source.table(examples, policy, cache_dir=self.cache_dir,
                                                 batch_size=self.batch_size, pad_token_id=self.pad_token_id,
                                                 device=self.device)
            self.tables[key] = table
            self.cache_hits[name] = hit
            logger.info("reference log-probs for %s %s %s", name, "loaded from" if hit else "computed and saved to",
                        path)
        return self.tables[key]


# ---------------------------------------------------------------------------------------------
# The one place the reference is decided
# ---------------------------------------------------------------------------------------------


def build_reference(args, *, policy, ref_model, backend: str, pad_token_id: int, accelerator) -> Reference:
    """The run's reference, loaded, chosen, prepared for the policy's engine and given its callbacks.

    ref_model: a model, a name/path (loaded in the policy's dtype, as TRL does) or None.
    The strategy TRL users expect: none for reference-free losses; a given model; the policy's adapter off
    for PEFT; else a frozen copy of the starting policy (TRL's `create_reference_model`);
    `precompute_ref_log_probs` wraps the chosen source in tables. TR-DPO's sync callback (`tr_dpo.py`,
    which refuses what TRL 1.16 refuses) lands in `callbacks`.
    """
    ref_model = prepare_reference(ref_model, args, backend=backend, policy_dtype=policy.dtype)
    reference = _choose(args, policy, ref_model, backend=backend, pad_token_id=pad_token_id,
                        device=accelerator.device)
    reference.prepare_for_engine(accelerator)
    sync = tr_dpo_callback(args, reference, policy)
    reference.callbacks = () if sync is None else (sync,)
    return reference


def _choose(args, policy, ref_model, *, backend: str, pad_token_id: int, device) -> Reference:
    if not args.needs_reference:
        return NoReference()
    chunk_size = args.logprob_chunk_size
    if ref_model is not None:
        source = SeparateModelReference(ref_model, chunk_size=chunk_size, backend=backend)
    elif is_peft_model(policy):
        source = AdapterReference(chunk_size=chunk_size, backend=backend)
    else:
        source = SeparateModelReference(reference_copy(unwrap(policy)), chunk_size=chunk_size, backend=backend)
    if not args.precompute_ref_log_probs:
        return source
    return PrecomputedReference(source, cache_dir=args.resolved_ref_cache_dir(),
                                batch_size=args.precompute_batch_size,
                                pad_token_id=pad_token_id, device=device)
