"""`data.loader.MicroBatch`: what the loader builds for each micro-batch, frozen once built, and how it travels
through a DataLoader (collate, pinning)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_examples
from prefixdpo.data.loader import LoaderSettings, MicroBatch, MicroBatches, make_dataloader


class Table:
    """A reference table of one value per response: 10 x example index + response index."""

    def gather(self, example_ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor([10.0 * e + k for e in example_ids.tolist() for k in range(2)])


def test_loader_items_are_frozen_micro_batches_with_their_facts():
    examples = make_examples(6)
    examples[4] = dataclasses.replace(examples[4], meta={"margin": 2.0})
    micro = MicroBatches(examples, LoaderSettings(batch_size=3, seed=1, grad_accum=2), ref_table=Table())
    items = [micro[m] for m in range(len(micro))]
    assert all(isinstance(item, MicroBatch) for item in items) and len(items) == 2
    for item in items:
        ids = item.example_ids.tolist()
        exs = [examples[e] for e in ids]
        assert item.step_pairs == 6  # both micro-batches make one optimizer step
        assert item.real_tokens == item.batch.num_real_tokens and item.slots == item.batch.input_ids.numel()
        assert item.shared_tokens == sum(ex.shared_length for ex in exs)
        assert item.unshared_tokens == sum(ex.unshared_length for ex in exs)
        assert item.ref_logps.tolist() == [10.0 * e + k for e in ids for k in range(2)]  # the batch's order
        expected = [2.0 if e == 4 else 0.0 for e in ids] if 4 in ids else None
        assert (None if item.margins is None else item.margins.tolist()) == expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        items[0].ref_logps = None


def test_a_dataloader_hands_over_the_micro_batch_and_pins_every_tensor(monkeypatch):
    """collate gives the MicroBatch itself; torch's pinning (what `pin_memory=True` runs on each item) gives a
    MicroBatch whose every tensor, the Batch's included, is pinned (faked here: pinning needs an accelerator)."""
    from torch.utils.data._utils.pin_memory import pin_memory

    micro = MicroBatches(make_examples(4), LoaderSettings(batch_size=2), ref_table=Table())
    (first, _) = list(make_dataloader(micro))
    assert isinstance(first, MicroBatch) and torch.equal(first.example_ids, micro[0].example_ids)

    pinned_ids = set()

    def fake_pin(t, *args, **kwargs):
        copy = t.clone()
        pinned_ids.add(id(copy))
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    pinned = pin_memory(first)
    assert isinstance(pinned, MicroBatch) and pinned is not first
    tensors = [pinned.example_ids, pinned.ref_logps,
               *(getattr(pinned.batch, f.name) for f in dataclasses.fields(pinned.batch)
                 if isinstance(getattr(pinned.batch, f.name), torch.Tensor))]
    assert len(tensors) == 14 and all(id(t) in pinned_ids for t in tensors)
    assert pinned.margins is None and (pinned.step_pairs, pinned.real_tokens) == (first.step_pairs, first.real_tokens)
    assert torch.equal(pinned.batch.input_ids, first.batch.input_ids)
