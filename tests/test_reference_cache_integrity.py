"""The reference cache proves its content (issue 17): a cache file with this key's name but edited sums, wrong
offsets, non-finite values, another key or cache version, or truncated or garbage bytes is a miss: the table is
recomputed with one warning line naming the file and why, it equals a clean computation exactly (the same
computation), and the file is rewritten (the next load is a hit holding the clean table). A training run over an
edited file equals a clean run (the edit once gave loss 0.0067 where the first step must be ln 2).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import prefixdpo.dpo.reference_cache as reference_cache
from prefixdpo.dpo.reference import reference_response_logps
from conftest import make_examples, tiny_model
from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer
from prefixdpo.core.attention.pass_plan import plan_pass
from tolerances import assert_same_dpo_log, assert_same_weights

SETTINGS = {"dtype": "torch.float32"}


def load_or_compute(model, examples, cache):
    """`load_or_compute_table` with `model` as a separate reference (its no-grad pass computes the sums)."""
    def sums_of(batch):
        return reference_response_logps(model, batch, plan_pass(batch, "sdpa")).sums

    return reference_cache.load_or_compute_table(model, examples, cache, settings=SETTINGS, sums_of=sums_of)


def _read(path):
    with safe_open(path, framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata())


def _rewrite(path, edit, *, reseal: bool):
    """Apply `edit(tensors, metadata)` to the file; `reseal` stores the edited payload's checksum, so only the
    check under test can catch the edit."""
    tensors, meta = _read(path)
    edit(tensors, meta)
    if reseal:
        table = reference_cache.RefLogpsTable(tensors["sums"], tensors["offsets"])
        meta["sha256"] = reference_cache.payload_checksum(table)
    save_file(tensors, path, metadata=meta)


def edited_sums(path):
    _rewrite(path, lambda t, m: t["sums"].__setitem__(1, t["sums"][1] + 5.0), reseal=False)


def wrong_offsets(path):  # example 0 given one response more, example 1 one fewer; still 0 .. numel
    _rewrite(path, lambda t, m: t["offsets"].__setitem__(1, t["offsets"][1] + 1), reseal=True)


def non_finite(path):
    _rewrite(path, lambda t, m: t["sums"].__setitem__(2, float("nan")), reseal=True)


def other_key(path):
    _rewrite(path, lambda t, m: m.__setitem__("key", "0" * 64), reseal=True)


def old_version(path):  # the v2 format: no version, no checksum
    _rewrite(path, lambda t, m: (m.pop("version"), m.pop("sha256")), reseal=False)


def truncated(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) - 7])


def garbage(path):
    open(path, "wb").write(b"\x93 not a safetensors file \x00" * 40)


FAULTS = {
    edited_sums: "does not match its checksum",
    wrong_offsets: "offsets give example 0 3 responses, it has 2",
    non_finite: "1 of its 12 values are not finite",
    other_key: "stored key",
    old_version: "cache version v2 or older",
    truncated: "unreadable (SafetensorError",
    garbage: "unreadable (SafetensorError",
}


@pytest.mark.parametrize("fault", list(FAULTS), ids=[f.__name__ for f in FAULTS])
def test_a_damaged_cache_file_is_recomputed_with_one_warning_and_repaired(tmp_path, caplog, fault):
    examples, model, cache = make_examples(6), tiny_model("llama"), str(tmp_path / "cache")
    clean, path, hit = load_or_compute(model, examples, cache)
    assert not hit and os.listdir(cache) == [os.path.basename(path)]
    fault(path)
    with caplog.at_level(logging.WARNING, logger="prefixdpo.dpo.reference_cache"):
        again, _, hit = load_or_compute(model, examples, cache)
    assert not hit
    assert torch.equal(again.sums, clean.sums) and torch.equal(again.offsets, clean.offsets)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and len(warnings[0].splitlines()) == 1, warnings
    assert path in warnings[0] and FAULTS[fault] in warnings[0], warnings[0]
    # repaired: one file, a hit, the clean table
    caplog.clear()
    repaired, _, hit = load_or_compute(model, examples, cache)
    assert hit and torch.equal(repaired.sums, clean.sums) and torch.equal(repaired.offsets, clean.offsets)
    assert os.listdir(cache) == [os.path.basename(path)] and not caplog.records


def test_a_failed_cache_write_is_a_warning_and_leaves_the_old_file(tmp_path, caplog, monkeypatch):
    examples, model, cache = make_examples(6), tiny_model("llama"), str(tmp_path / "cache")
    clean, path, _ = load_or_compute(model, examples, cache)
    garbage(path)
    before = open(path, "rb").read()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    with caplog.at_level(logging.WARNING, logger="prefixdpo.dpo.reference_cache"):
        table, _, hit = load_or_compute(model, examples, cache)
    assert not hit and torch.equal(table.sums, clean.sums)
    assert [r.getMessage().split(" ")[:3] for r in caplog.records] == [["reference", "cache", path],
                                                                         ["could", "not", "save"]]
    assert os.listdir(cache) == [os.path.basename(path)] and open(path, "rb").read() == before


def _train(tmp_path, examples):
    args = PrefixDPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0, beta=0.5, ref_cache_dir=str(tmp_path / "cache"), report_to="none",
        gradient_checkpointing=False, precompute_ref_log_probs=True)
    trainer = PrefixDPOTrainer(model=tiny_model("llama"), args=args, train_dataset=examples)
    trainer.train()
    return trainer.reference.cache_hits["train"], [h for h in trainer.state.log_history if "loss" in h], \
        dict(trainer.model.named_parameters())


def test_a_run_over_edited_sums_equals_a_clean_run(tmp_path):
    examples = make_examples(12)
    hit, clean_logs, clean_params = _train(tmp_path, examples)
    assert not hit and clean_logs[0]["loss"] == pytest.approx(0.6931472, rel=1e-6)  # reference == policy at step 1
    (path,) = (tmp_path / "cache").iterdir()
    _rewrite(str(path), lambda t, m: t["sums"].mul_(1.5), reseal=False)
    hit, logs, params = _train(tmp_path, examples)
    assert not hit and len(logs) == len(clean_logs) == 3
    for a, b in zip(clean_logs, logs):  # the table recomputed, the same steps: a few ulps of their magnitudes
        assert_same_dpo_log(a, b, 0.5, ("loss", "rewards/chosen", "logps/chosen"), what=f"step {a['step']}")
    assert_same_weights(params, clean_params)
