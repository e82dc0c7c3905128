"""What sequence parallelism saves per rank on one long row: the activation memory of a policy pass's forward and
backward, measured on this process (`core.sequence_parallel`).

Two measurements, both of one `compute_response_logps` pass with gradient and its backward:

- saved for backward: the bytes of the distinct tensors autograd keeps between forward and backward
  (`torch.autograd.graph.saved_tensors_hooks`), the model's parameters left out: activation memory exactly, the
  same on every device. The whole line's attention mask and the copies an attention kernel keeps of it
  ([B, 1, L, L]: dense SDPA keeps one per layer), which every rank holds whole, are counted apart (`mask_bytes`);
- peak memory: `PeakMemory` around the pass (CUDA: max allocated; Linux CPU: peak RSS growth, coarser).

Run it in one process and on each rank of a group with the same row: the per-rank share is the ratio.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from prefixdpo.core import sequence_parallel
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo_tools.bench.memory import PeakMemory


@dataclass(frozen=True)
class RowMemory:
    """One pass's memory on this rank. saved_bytes: activations kept for backward (mask apart); mask_bytes: the
    attention mask's share of what is kept; peak_bytes: `PeakMemory`'s (its `method`); sums: the responses'
    log-prob sums (every rank gets them all)."""

    tokens: int
    saved_bytes: int
    mask_bytes: int
    peak_bytes: int
    method: str
    sums: list[float]

    def as_dict(self) -> dict:
        return asdict(self)


def long_row(prompt: int, responses: tuple[int, ...], vocab: int, seed: int = 0) -> Example:
    """A prompt of `prompt` random tokens and responses of the given lengths (pairs: the first vs each other)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    return Example(ids(prompt), [ids(n) for n in responses], pairs=[(0, k) for k in range(1, len(responses))])


def measure_row(model, example: Example, backend: str, device, sp: sequence_parallel.SequenceParallel | None = None,
                chunk_size: int = 1024) -> RowMemory:
    """`RowMemory` of a policy pass over `example`'s row (padded to the group's size) and its backward."""
    batch = build_batch([example], pad_multiple=1 if sp is None else sp.size).to(device)
    mask = plan_pass(batch, backend)
    sequence_parallel.attach(model, sp)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    length = batch.input_ids.shape[1]
    kept: dict[int, int] = {}
    masks: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            # the line's mask, or a copy an attention kernel made of it ([B, 1, L, L], the same on every rank)
            whole_line = t.dim() == 4 and t.shape[1] == 1 and t.shape[-2:] == (length, length)
            (masks if whole_line else kept)[ptr] = t.untyped_storage().nbytes()
        return t

    meter = PeakMemory(device)
    with meter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = compute_response_logps(model, batch, mask, chunk_size=chunk_size)
        out.sums.sum().backward()
    sequence_parallel.attach(model, None)
    return RowMemory(tokens=int(length), saved_bytes=sum(kept.values()), mask_bytes=sum(masks.values()), peak_bytes=int(meter.peak_bytes), method=meter.method,
                     sums=out.sums.detach().cpu().tolist())


__all__ = ["RowMemory", "long_row", "measure_row"]
