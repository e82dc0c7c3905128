"""Ctrl-C at any instant is one line and exit 130: while the command is still importing its libraries (before any
work), and during an evaluation inside training, where it stops the evaluation, saves the last completed optimizer
step's checkpoint and exits without running a further step."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixdpo.cli import main
from prefixdpo.training import checkpoints

pytestmark = pytest.mark.usefixtures("no_progress_bars")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny model, and a dataset folder with a training file and a held-out `test.jsonl` of 16 records."""
    from prefixdpo_tools.demo import DemoSpec, build_demo

    work = tmp_path_factory.mktemp("interrupts")
    build_demo(work / "base", DemoSpec(num_train=24, num_eval=16, hidden_size=32, intermediate_size=64,
                                       num_heads=2, vocab_size=300))
    (work / "data").mkdir()
    shutil.copy(work / "base" / "train.jsonl", work / "data" / "train.jsonl")
    shutil.copy(work / "base" / "eval.jsonl", work / "data" / "test.jsonl")
    return work


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
STOPPED_BEFORE = "prefixdpo train: stopped at once by Ctrl-C before it started"
STOPPED_TRAINING = ("prefixdpo train: stopped at once by Ctrl-C: the current step and any checkpoint being written "
                    "are lost; complete checkpoints are intact (resume with --resume_from_checkpoint latest)")


@pytest.fixture(scope="module")
def import_seconds() -> float:
    """Seconds from a new interpreter's start to a built command line (importing torch, transformers and TRL): 2 to 8
    on the machines measured, so the Ctrl-C of the next test is timed as fractions of it, not in fixed seconds (a fast
    machine was past its imports by a fixed 3 s)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "from prefixdpo.cli import build_parser; build_parser()"], env=ENV,
                   check=True, capture_output=True)
    return time.monotonic() - started


def test_ctrl_c_while_importing_is_one_line_and_exit_130(tmp_path, import_seconds):
    """(~8 s) SIGINT a few moments after `prefixdpo train` starts, while it imports torch, transformers and TRL
    (0.1, 0.3 and 0.5 of the imports' measured time, before any option is read): exit 130 and one line on stderr,
    never a traceback. This process's imports can run faster than the measured ones (on a busy machine, CI saw a
    0.6 land after them, in the demo's set-up): a Ctrl-C there ends with the training command's own line, also exit
    130 and no traceback; the earliest (0.1) must land while importing."""
    endings = []
    for fraction in (0.1, 0.3, 0.5):
        output = tmp_path / f"o{fraction}"
        process = subprocess.Popen([sys.executable, "-m", "prefixdpo.cli", "train", "--output_dir", str(output)],
                                   env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(fraction * import_seconds)
        assert process.poll() is None, "the command ended before the Ctrl-C: this test's point is not reached"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
        assert process.returncode == 130, err[-3000:]
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
        lines = err.strip().splitlines()
        if lines[-1] == STOPPED_BEFORE:
            assert lines == [STOPPED_BEFORE], err[-3000:]
        else:
            assert lines[-1] == STOPPED_TRAINING, err[-3000:]
        endings.append(lines[-1])
        assert not (output / "model.safetensors").exists()
    assert endings[0] == STOPPED_BEFORE, endings


def test_ctrl_c_while_the_parser_imports_ends_the_process_from_the_handler(tmp_path):
    """(~1 s) A Ctrl-C that lands while `prefixdpo train` builds its parser (importing its libraries) ends the process
    at once from the signal handler: exit 130 and one line, without waiting for the imports to finish (here a parser
    build that would take 30 s more) and without a KeyboardInterrupt raised inside a module being imported (here one
    that swallows it: without the handler, this process ends with an AssertionError's traceback)."""
    script = (
        "import os, signal, sys, time\n"
        "import prefixdpo.cli as cli\n"
        "def slow_build():\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        time.sleep(30)\n"
        "    except KeyboardInterrupt:\n"  # what a module importing may do to it: swallow or wrap it
        "        pass\n"
        "    raise AssertionError('the Ctrl-C did not end the process')\n"
        "cli.build_parser = slow_build\n"
        "sys.argv = ['prefixdpo', 'grpo']\n"
        "sys.exit(cli.main())\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == ["prefixdpo grpo: stopped at once by Ctrl-C before it started"]
    assert time.monotonic() - started < 25, "the process waited for the imports to end"


def _interrupt_wrapped_by_an_import() -> ModuleNotFoundError:
    """What a Ctrl-C inside `class LogRegistry:` (torch._logging, a dataclass) reached the CLI as, in a CI run:
    KeyboardInterrupt -> RuntimeError("Error calling __set_name__ ...") -> transformers' ModuleNotFoundError."""
    try:
        try:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as ctrl_c:
                raise RuntimeError("Error calling __set_name__ on 'Field' instance") from ctrl_c
        except RuntimeError as inner:
            raise ModuleNotFoundError("Could not import module 'TrainingArguments'") from inner
    except ModuleNotFoundError as outer:
        return outer


def test_a_ctrl_c_wrapped_by_an_import_while_building_the_parser_is_one_line(monkeypatch, capsys):
    """A Ctrl-C that an import turned into another error while the parser was built: one line and 130, as a bare
    KeyboardInterrupt is, never that error's traceback (the CI failure of stop 41)."""
    from prefixdpo import cli

    def build_parser():
        raise _interrupt_wrapped_by_an_import()

    monkeypatch.setattr(cli, "build_parser", build_parser)
    assert cli.main(["train", "--output_dir", "x"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "prefixdpo train: stopped at once by Ctrl-C before it started"]


def test_a_ctrl_c_wrapped_by_an_import_while_a_command_runs_is_one_line(monkeypatch, capsys):
    """The same wrapped Ctrl-C raised by a command's own late imports: the command's one Ctrl-C line and 130; an
    import error with no Ctrl-C among its causes still propagates as the bug it is."""
    from prefixdpo import cli
    from prefixdpo.commands import inspect as inspect_command

    def wrapped(args):
        raise _interrupt_wrapped_by_an_import()

    monkeypatch.setattr(inspect_command, "run", wrapped)
    assert cli.main(["inspect", "data.jsonl", "--tokenizer", "t"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["prefixdpo inspect: stopped at once by Ctrl-C"]

    def plain(args):
        raise ModuleNotFoundError("no module named 'a_missing_dependency'")

    monkeypatch.setattr(inspect_command, "run", plain)
    with pytest.raises(ModuleNotFoundError, match="a_missing_dependency"):
        cli.main(["inspect", "data.jsonl", "--tokenizer", "t"])


def test_ctrl_c_during_evaluation_stops_it_saves_the_last_step_and_runs_no_further_step(base, tmp_path, capfd,
                                                                                        monkeypatch):
    """(~10 s) A Ctrl-C during the second batch of the evaluation after optimizer step 2 (eval every 2 steps, one
    held-out pair per batch): the evaluation stops at that batch, a complete checkpoint of step 2 is saved (none of
    step 3), nothing is exported, and the run ends with one line naming step 2 and the resume option, exit 130."""
    from prefixdpo.dpo.trainer import PrefixDPOTrainer

    original = PrefixDPOTrainer._pair_step
    seen = {"eval_batches": 0, "train_steps_after": 0}

    def pair_step(self, model, inputs, split):
        if split == "eval" and self.state.global_step == 2:
            seen["eval_batches"] += 1
            if seen["eval_batches"] == 2:
                os.kill(os.getpid(), signal.SIGINT)
        elif split != "eval" and self.state.global_step >= 2:
            seen["train_steps_after"] += 1
        return original(self, model, inputs, split)

    monkeypatch.setattr(PrefixDPOTrainer, "_pair_step", pair_step)
    out_dir = tmp_path / "run"
    code = main(["train", "--model", str(base / "base" / "model"), "--dataset", str(base / "data"),
                 "--output_dir", str(out_dir), "--max_steps", "6", "--eval_strategy", "steps", "--eval_steps", "2",
                 "--per_device_eval_batch_size", "1", "--save_strategy", "steps", "--save_steps", "100",
                 "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--bf16", "false",
                 "--logging_steps", "1", "--gradient_checkpointing", "false", "--disable_tqdm", "true",
                 "--report_to", "none"])
    out, err = capfd.readouterr()  # the handler writes to fd 2 itself
    assert code == 130, err[-3000:]
    assert seen["eval_batches"] == 2, "the evaluation ran on after the Ctrl-C"
    assert seen["train_steps_after"] == 0, "an optimizer step ran after the Ctrl-C"
    assert "Ctrl-C: stopping the evaluation, then saving a checkpoint of the last completed optimizer step" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("prefixdpo train: interrupted (Ctrl-C) at step 2 of 6: checkpoint saved to "), err[-3000:]
    assert checkpoints.checkpoint_problem(str(out_dir / "checkpoint-2"), None) is None
    assert json.loads((out_dir / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    assert not (out_dir / "checkpoint-3").exists() and not (out_dir / "model.safetensors").exists()
    assert "Model saved" not in out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the run's handler is put back
