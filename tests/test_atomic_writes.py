"""Files the project writes are whole or not there (issue 17): a writer that fails half way (injected: the disk
fills after half the bytes, or a build step raises) leaves the previous file, or folder, exactly as it was and no
temporary file behind; a later write succeeds. Covered: gpu-check's reports (text, the same helper as bench.md and
bench.json), a drawn mask (savefig, as the bench chart), the exported model's config rewrite, and the embedded
default's build (a failure in the middle never leaves a folder a later run would take as built).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os

import pytest

from conftest import random_examples


@contextlib.contextmanager
def disk_fills_halfway(monkeypatch, name: str):
    """Every file opened for writing whose name starts with `name` (a temporary name beside it too) takes half of
    what is written to it, then raises ENOSPC."""
    real_open = builtins.open

    class HalfFile:
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            self.fh.write(data[: len(data) // 2])
            self.fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, attr):
            return getattr(self.fh, attr)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    def failing_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        writing = any(c in mode for c in "wax")
        return HalfFile(fh) if writing and os.path.basename(os.fspath(file)).startswith(name) else fh

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", failing_open)
        patch.setattr(io, "open", failing_open)
        yield


def _snapshot(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def test_reports_survive_a_writer_that_fails_halfway(tmp_path, monkeypatch):
    from prefixdpo_tools import gpu_check

    old = [gpu_check.CheckResult("verify", "llama float32 sdpa", "ok", "rel dlogp 1e-07")]
    new = old + [gpu_check.CheckResult("bench", "tldr sdpa", "error", "RuntimeError: x" * 200)]
    gpu_check.write_reports(old, {"device": "first"}, tmp_path)
    old_md = (tmp_path / "gpu-check.md").read_text()
    with disk_fills_halfway(monkeypatch, "gpu-check.md"), pytest.raises(OSError, match="No space"):
        gpu_check.write_reports(new, {"device": "second"}, tmp_path)  # the json is written, then the md fails
    assert sorted(os.listdir(tmp_path)) == ["gpu-check.json", "gpu-check.md"]  # no temporary file left
    assert (tmp_path / "gpu-check.md").read_text() == old_md
    assert json.loads((tmp_path / "gpu-check.json").read_text())["meta"] == {"device": "second"}  # whole
    gpu_check.write_reports(new, {"device": "third"}, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["gpu-check.json", "gpu-check.md"]
    assert "RuntimeError: x" in (tmp_path / "gpu-check.md").read_text()


def test_a_drawing_survives_a_savefig_that_fails_halfway(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from prefixdpo.core.attention.draw import draw_mask
    from prefixdpo.data.batch import build_batch

    batch = build_batch(random_examples(), prefix_sharing=True, packs=[[0, 1, 2]], length=64)
    path = draw_mask(batch, tmp_path / "mask.png")
    before = _snapshot(tmp_path)

    def torn_savefig(self, fname, *args, **kwargs):
        with open(fname, "wb") as fh:
            fh.write(b"\x89PNG\r\n\x1a\n half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", torn_savefig)
    with pytest.raises(OSError, match="No space"):
        draw_mask(batch, path, line=0, title="again")
    assert _snapshot(tmp_path) == before


def test_the_exported_config_survives_a_rewrite_that_fails_halfway(tmp_path, monkeypatch):
    from prefixdpo.core.attention.backends import ATTENTION_NAME
    from prefixdpo.core.model_checks import restore_stock_attention

    saved = json.dumps({"_attn_implementation": ATTENTION_NAME, "hidden_size": 32, "notes": "n" * 500})
    (tmp_path / "config.json").write_text(saved)
    with disk_fills_halfway(monkeypatch, "config.json"), pytest.raises(OSError, match="No space"):
        restore_stock_attention(str(tmp_path))
    assert os.listdir(tmp_path) == ["config.json"] and (tmp_path / "config.json").read_text() == saved
    restore_stock_attention(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["_attn_implementation"] == "sdpa"


def _files(folder):
    return {os.path.relpath(os.path.join(r, n), folder): open(os.path.join(r, n), "rb").read()
            for r, _, names in os.walk(folder) for n in names}


def test_a_demo_build_that_fails_midway_leaves_no_half_folder(tmp_path, monkeypatch):
    import prefixdpo_tools.demo as demo
    from prefixdpo import PrefixDPOConfig

    spec = demo.DemoSpec(num_train=40, num_eval=8, vocab_size=300, hidden_size=32, intermediate_size=64)
    real_write = demo.write_jsonl

    def fail_on_eval(records, path):  # the model, tokenizer and train split are written by then
        if path.name == "eval.jsonl":
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(records, path)

    target = tmp_path / "run" / "demo-base"
    with monkeypatch.context() as patch:
        patch.setattr(demo, "write_jsonl", fail_on_eval)
        with pytest.raises(OSError, match="No space"):
            demo.build_demo(target, spec)
    assert os.listdir(target.parent) == []  # nothing a later run could take as built

    first = demo.build_demo(target, spec)
    built = _files(target)
    with monkeypatch.context() as patch:  # a failed rebuild over a complete one leaves the complete one
        patch.setattr(demo, "write_jsonl", fail_on_eval)
        with pytest.raises(OSError, match="No space"):
            demo.build_demo(target, spec)
    assert _files(target) == built and os.listdir(target.parent) == ["demo-base"]

    args = PrefixDPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none")
    paths = demo.build_demo_for_run(target, args, spec=spec)  # a run builds its own, whole
    assert paths == first and (paths.model_dir / "model.safetensors").is_file() and paths.eval_file.is_file()
    rebuilt = _files(target)
    assert rebuilt.pop(demo.BUILD_FILE) != built.pop(demo.BUILD_FILE) and rebuilt == built
