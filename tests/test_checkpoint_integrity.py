"""Checkpoints that prove themselves, and saves that say why they failed (issue 35, findings 2-4).

Each fault is injected for real into a tiny `prefixdpo train` run through the command line: a checkpoint file
corrupted in place without changing its size (zeroed bytes, random bytes at its start), a manifest from before
digests, a disk that fills during a save (the writer fails with ENOSPC, or torch's opaque RuntimeError while the
disk reports no free space). Each ends in the exact one line, the exit code, and nothing lost or claimed."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from prefixdpo.cli import main
from prefixdpo.training import checkpoint_integrity, checkpoints, disk_space

pytestmark = pytest.mark.usefixtures("no_progress_bars")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from prefixdpo_tools.demo import DemoSpec, build_demo

    work = tmp_path_factory.mktemp("integrity")
    build_demo(work / "base", DemoSpec(num_train=48, num_eval=4, hidden_size=32, intermediate_size=64,
                                       num_heads=2, vocab_size=300))
    return work


def _train(base: Path, out: Path, *extra: str) -> int:
    return main(["train", "--model", str(base / "base" / "model"), "--dataset", str(base / "base" / "train.jsonl"),
                 "--output_dir", str(out), "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
                 "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--bf16", "false",
                 "--gradient_checkpointing", "false", "--disable_tqdm", "true", "--report_to", "none", *extra])


@pytest.fixture(scope="module")
def two_checkpoints(base):
    """A finished 4-step run with checkpoint-2 and checkpoint-4, copied afresh by each test (`_copy`)."""
    out = base / "two-checkpoints"
    assert _train(base, out) == 0
    return out


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _zero_second_half(path: Path) -> None:
    data = bytearray(path.read_bytes())
    half = len(data) // 2
    data[half:] = bytes(len(data) - half)
    path.write_bytes(bytes(data))  # the same size: the size manifest alone cannot see it


def _random_start(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[:n] = os.urandom(n)
    path.write_bytes(bytes(data))


def _lines(text: str, mark: str) -> list[str]:
    return [line for line in text.splitlines() if mark in line]


def test_seal_records_a_digest_of_every_file(two_checkpoints):
    folder = two_checkpoints / "checkpoint-4"
    state = checkpoints.read_state(str(folder))
    assert state["digests"]["algorithm"] == "xxh3_128"
    assert set(state["digests"]["files"]) == set(state["files"]) >= {"model.safetensors", "optimizer.pt"}
    for name, digest in state["digests"]["files"].items():
        assert checkpoint_integrity.file_digest(str(folder / name)) == digest


def test_latest_passes_over_zeroed_weights_and_resumes_from_the_previous_checkpoint(base, two_checkpoints, capsys):
    """Finding 2: the second half of the newest model.safetensors zeroed, its size unchanged: `latest` names it,
    says why and resumes from checkpoint-2, and the run finishes."""
    out = _copy(two_checkpoints, base / "zeroed")
    written = checkpoints.read_state(str(out / "checkpoint-4"))["digests"]["files"]["model.safetensors"]
    _zero_second_half(out / "checkpoint-4" / "model.safetensors")
    now = checkpoint_integrity.file_digest(str(out / "checkpoint-4" / "model.safetensors"))
    capsys.readouterr()
    assert _train(base, out, "--resume_from_checkpoint", "latest", "--max_steps", "6") == 0
    captured = capsys.readouterr()
    expected = (f"prefixdpo: skipped {out / 'checkpoint-4'}: model.safetensors does not match its digest (written "
                f"{written[:12]}..., now {now[:12]}...): its content changed after the save; resuming from "
                "checkpoint-2 instead")
    assert _lines(captured.out + captured.err, "skipped") == [expected]
    assert "Traceback" not in captured.err
    # resumed from step 2: steps 3..6 ran, and checkpoint-4 was written again, whole
    assert checkpoints.checkpoint_problem(str(out / "checkpoint-4"), None) is None
    assert checkpoints.checkpoint_problem(str(out / "checkpoint-6"), None) is None
    assert (out / "model.safetensors").exists() and "Model saved" in captured.out


def test_latest_passes_over_an_optimizer_file_with_random_bytes_at_its_start(base, two_checkpoints, capsys):
    """Finding 3: random bytes at the start of optimizer.pt (size unchanged) -> no UnpicklingError traceback:
    skipped in one line, resumed from checkpoint-2."""
    out = _copy(two_checkpoints, base / "optimizer-start")
    _random_start(out / "checkpoint-4" / "optimizer.pt")
    capsys.readouterr()
    assert _train(base, out, "--resume_from_checkpoint", "latest", "--max_steps", "6") == 0
    captured = capsys.readouterr()
    (line,) = _lines(captured.out + captured.err, "skipped")
    assert line.startswith(f"prefixdpo: skipped {out / 'checkpoint-4'}: optimizer.pt does not match its digest")
    assert line.endswith("resuming from checkpoint-2 instead") and "Traceback" not in captured.err
    assert checkpoints.checkpoint_problem(str(out / "checkpoint-6"), None) is None


def test_a_named_corrupt_checkpoint_is_refused_in_one_line(base, two_checkpoints, capsys):
    out = _copy(two_checkpoints, base / "named")
    _zero_second_half(out / "checkpoint-4" / "model.safetensors")
    capsys.readouterr()
    assert _train(base, out, "--resume_from_checkpoint", str(out / "checkpoint-4"), "--max_steps", "6") == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert re.fullmatch(rf"prefixdpo train: error: resume_from_checkpoint={re.escape(str(out / 'checkpoint-4'))} "
                        r"cannot be resumed: model\.safetensors does not match its digest "
                        r"\(written [0-9a-f]{12}\.\.\., now [0-9a-f]{12}\.\.\.\): its content changed after the "
                        r"save", line), line
    assert not (out / "checkpoint-6").exists() and "Model saved" not in captured.out


def test_latest_with_no_valid_checkpoint_is_one_line_and_exit_2(base, capsys):
    out = base / "only-one"
    assert _train(base, out, "--max_steps", "2") == 0
    _random_start(out / "checkpoint-2" / "optimizer.pt")
    capsys.readouterr()
    assert _train(base, out, "--resume_from_checkpoint", "latest") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"prefixdpo train: error: resume_from_checkpoint='latest': no complete, valid "
                           f"checkpoint in {out} (checkpoint-2: optimizer.pt does not match its digest (written ")
    assert line.endswith("run without --resume_from_checkpoint to start again from step 0")
    assert (out / "checkpoint-2").is_dir()  # refused, not deleted: the user decides


def _strip_digests(folder: Path) -> None:
    """Make `folder`'s manifest what a prefixdpo before digests wrote (sizes only)."""
    state_file = folder / checkpoints.STATE_FILE
    state = json.loads(state_file.read_text())
    del state["digests"]
    state_file.write_text(json.dumps(state))


def test_a_checkpoint_saved_before_digests_resumes_and_says_so_once(base, two_checkpoints, capsys):
    out = _copy(two_checkpoints, base / "old-manifest")
    _strip_digests(out / "checkpoint-4")
    capsys.readouterr()
    assert _train(base, out, "--resume_from_checkpoint", "latest", "--max_steps", "6") == 0
    captured = capsys.readouterr()
    assert _lines(captured.out + captured.err, "without content digests") == [
        "prefixdpo: checkpoint-4 was saved without content digests (an older prefixdpo): its sizes, structure and "
        "stored CRCs were checked, not every byte"]
    assert not _lines(captured.out + captured.err, "skipped")


def test_a_checkpoint_saved_before_digests_that_does_not_load_is_passed_over(base, two_checkpoints, capsys):
    """No digest to compare: the structure check still sees random bytes at the start of optimizer.pt."""
    out = _copy(two_checkpoints, base / "old-manifest-torn")
    _strip_digests(out / "checkpoint-4")
    _random_start(out / "checkpoint-4" / "optimizer.pt")
    capsys.readouterr()
    assert _train(base, out, "--resume_from_checkpoint", "latest", "--max_steps", "6") == 0
    captured = capsys.readouterr()
    (line,) = _lines(captured.out + captured.err, "skipped")
    assert line.startswith(f"prefixdpo: skipped {out / 'checkpoint-4'}: optimizer.pt does not load (not a valid "
                           "torch archive: ")
    assert line.endswith("; resuming from checkpoint-2 instead")


def test_a_file_that_matches_its_digest_but_does_not_load_is_one_line(base, two_checkpoints, capsys):
    """Defence in depth: optimizer.pt replaced by bytes that are no torch file, and the manifest made to vouch for
    them (size and digest): the pre-check cannot see it, the load fails, and that is one line, exit 2."""
    out = _copy(two_checkpoints, base / "vouched")
    folder = out / "checkpoint-4"
    (folder / "optimizer.pt").write_bytes(b"\x80\x04not a pickle at all" + os.urandom(200))
    state = json.loads((folder / checkpoints.STATE_FILE).read_text())
    state["files"]["optimizer.pt"] = (folder / "optimizer.pt").stat().st_size
    state["digests"]["files"]["optimizer.pt"] = checkpoint_integrity.file_digest(str(folder / "optimizer.pt"))
    (folder / checkpoints.STATE_FILE).write_text(json.dumps(state))
    capsys.readouterr()
    assert _train(base, out, "--resume_from_checkpoint", str(folder), "--max_steps", "6") == 2
    captured = capsys.readouterr()
    (line,) = _lines(captured.err, "prefixdpo")  # (torch warns about the pickle protocol first: its own line)
    assert line.startswith(f"prefixdpo train: error: resume_from_checkpoint={folder} does not load (UnpicklingError: ")
    assert "Traceback" not in captured.err
    assert line.endswith("resume from an earlier checkpoint, or run without --resume_from_checkpoint to start again")
    assert not (out / "checkpoint-6").exists() and "Model saved" not in captured.out


# ---- a full disk during a save ----------------------------------------------------------------------------------


def _fail_optimizer_writes(monkeypatch, error: Exception, after: int = 1) -> None:
    """torch.save of optimizer.pt writes half its bytes, then raises `error`, from its `after`+1-th call on (the
    first checkpoint(s) save whole): a disk that fills during a save."""
    real_save = torch.save
    calls = {"n": 0}

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and str(f).endswith("optimizer.pt"):
            calls["n"] += 1
            if calls["n"] > after:
                real_save(obj, f, *args, **kwargs)
                Path(f).write_bytes(Path(f).read_bytes()[: os.path.getsize(f) // 2])
                raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def _assert_nothing_lost_or_claimed(out: Path, captured) -> None:
    assert checkpoints.checkpoint_problem(str(out / "checkpoint-2"), None) is None  # intact, digests and all
    assert not (out / "checkpoint-4").exists() and not (out / "model.safetensors").exists()
    assert not [p for p in os.listdir(out) if p.endswith(".staging")]  # its space given back
    assert "Model saved" not in captured.out and "Traceback" not in captured.err


def _no_space_line(out) -> str:
    """The one line of a save that ran out of space at checkpoint-4 of a run whose checkpoint-2 is complete."""
    return (f"prefixdpo train: error: checkpoint-4 could not be saved in {out}: no space left on device; the last "
            f"complete checkpoint is {out / 'checkpoint-2'} (free space, then resume with --resume_from_checkpoint "
            "latest)")


def test_a_save_that_runs_out_of_space_is_one_line_naming_the_last_checkpoint(base, monkeypatch, capsys):
    out = base / "enospc"
    _fail_optimizer_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    capsys.readouterr()
    assert _train(base, out) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line == _no_space_line(out)
    _assert_nothing_lost_or_claimed(out, captured)


def test_torchs_opaque_write_error_on_a_full_disk_says_no_space(base, monkeypatch, capsys):
    """torch's `unexpected pos` RuntimeError names no cause: the folder's free space (here: 4 KiB) tells."""
    out = base / "torch-full"
    _fail_optimizer_writes(monkeypatch, RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 4672 vs 4560"))
    real_usage = shutil.disk_usage
    monkeypatch.setattr(disk_space.shutil, "disk_usage",
                        lambda path: real_usage(path)._replace(free=4096))
    capsys.readouterr()
    assert _train(base, out) == 2
    captured = capsys.readouterr()
    warning, line = captured.err.strip().splitlines()  # 4 KiB free: also the warning at start
    assert warning.startswith(f"prefixdpo: warning: {out} has 4.0 KiB free, less than one checkpoint needs")
    assert line == _no_space_line(out)
    _assert_nothing_lost_or_claimed(out, captured)


def test_a_warning_at_start_when_one_checkpoint_will_not_fit(base, monkeypatch, capsys):
    from safetensors.torch import load_file

    out = base / "short-of-space"
    real_usage = shutil.disk_usage
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=1000))
    capsys.readouterr()
    assert _train(base, out, "--max_steps", "2") == 0  # a warning, not a refusal: the space may be freed
    captured = capsys.readouterr()
    weights = sum(t.numel() * t.element_size() for t in load_file(str(base / "base" / "model" / "model.safetensors"))
                  .values())
    needed = int(3 * weights * 1.02) + (1 << 20)
    assert _lines(captured.err, "warning:") == [
        f"prefixdpo: warning: {out} has 1000 bytes free, less than one checkpoint needs (about "
        f"{disk_space.human_bytes(needed)}: weights {disk_space.human_bytes(weights)} + optimizer state "
        f"{disk_space.human_bytes(2 * weights)}); saving a checkpoint will fail unless space is freed"]
    # no checkpoints saved: no warning
    capsys.readouterr()
    assert _train(base, base / "no-saves", "--max_steps", "1", "--save_strategy", "no") == 0
    assert not _lines(capsys.readouterr().err, "warning:")


def test_safetensors_quoting_a_full_disk_is_said_as_such(base, monkeypatch, capsys):
    """safetensors reports ENOSPC as a SafetensorError quoting Rust's io::Error: the same one line, here for the
    model file of the first checkpoint (none complete before it)."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # what fitted before the disk filled
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')

    out = base / "safetensors-full"
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    capsys.readouterr()
    assert _train(base, out) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line == (f"prefixdpo train: error: checkpoint-2 could not be saved in {out}: no space left on device; no "
                    "complete checkpoint was saved before it (free space and run again)")
    assert os.listdir(out) == [] and "Model saved" not in captured.out


def test_the_cause_of_a_failed_save_in_each_disguise(tmp_path, monkeypatch):
    """What `save_failure_cause` reads from each writer's error (the command-line tests above show the lines)."""
    from safetensors import SafetensorError

    cause = disk_space.save_failure_cause
    assert cause(OSError(errno.ENOSPC, "No space left on device"), str(tmp_path)) == "no space left on device"
    assert cause(OSError(errno.EDQUOT, "Disk quota exceeded"), str(tmp_path)) == "disk quota exceeded"
    assert cause(OSError(errno.EIO, "Input/output error"), str(tmp_path)) == "input/output error"
    assert cause(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                 str(tmp_path)) == "no space left on device"
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert cause(wrapped, str(tmp_path)) == "no space left on device"
    opaque = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4672 vs 4560")
    real_usage = shutil.disk_usage
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=10 << 30))
    assert cause(opaque, str(tmp_path / "not-yet")) == (
        "a write failed (torch: [enforce fail at inline_container.cc:672] . unexpected pos 4672 vs 4560; "
        "10.0 GiB free)")
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=0))
    assert cause(opaque, str(tmp_path / "not-yet")) == "no space left on device"
    # anything else is a bug: no cause, its traceback kept
    assert cause(RuntimeError("shape mismatch"), str(tmp_path)) is None
    assert cause(OSError(errno.ENOENT, "No such file or directory"), str(tmp_path)) is None
