"""Runs that survive: a training run killed at any instant, or preempted, loses at most the work since its last
complete checkpoint, resumes from that checkpoint with `--resume_from_checkpoint latest`, and ends with the
weights of an uninterrupted run; checkpoints of another run are never taken as this run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import preempt_after, run_fault_trials
import torch

from prefixdpo.training import checkpoints
from prefixdpo.cli import main
from tolerances import assert_same_weights

HERE = Path(__file__).resolve().parent

# (fault point, optimizer step) -> the newest complete checkpoint when the fault strikes (save_steps 3)
TRIALS = [
    *({"point": "mid_step", "step": s, "expect": 3 * ((s - 1) // 3)} for s in (4, 8, 11)),
    *({"point": "between_steps", "step": s, "expect": 3 * (s // 3)} for s in (5, 6, 10)),
    *({"point": "after_model_file", "step": s, "expect": s - 3} for s in (6, 9, 12)),
    *({"point": "after_optimizer", "step": s, "expect": s - 3} for s in (6, 12)),
    *({"point": "mid_optimizer_file", "step": s, "expect": s - 3} for s in (6, 9)),
    {"point": "mid_model_file", "step": 9, "expect": 6},
    *({"point": "before_our_state", "step": s, "expect": s - 3} for s in (6, 12)),
    {"point": "before_rename", "step": 9, "expect": 6},
    {"point": "mid_rotation", "step": 9, "expect": 9},  # checkpoint-9 is sealed before the oldest is deleted
    {"point": "mid_export", "step": 12, "expect": 12},
    *({"point": "sigterm", "step": s, "expect": s} for s in (5, 10)),  # preempted: a checkpoint at that step
    {"point": "sigusr1", "step": 7, "expect": 7},
    {"point": "sigint", "step": 4, "expect": 4},  # a first Ctrl-C: as SIGTERM, exit 130
    {"point": "sigint_twice", "step": 8, "expect": 6},  # a second one inside step 8's save: at once, 8 never in view
]


def _tiny_base(folder: Path) -> None:
    from prefixdpo_tools.demo import DemoSpec, build_demo

    build_demo(folder, DemoSpec(num_train=48, num_eval=4, hidden_size=32, intermediate_size=64, num_heads=2,
                                vocab_size=300))


# stderr holds exactly what a command writes: transformers' loading bars off (conftest.no_progress_bars)
pytestmark = pytest.mark.usefixtures("no_progress_bars")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    work = tmp_path_factory.mktemp("survival")
    _tiny_base(work / "base")
    return work


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_kill_anywhere_resumes_from_the_newest_complete_checkpoint(base):
    """24 trials: SIGKILL inside steps, between them, and inside saves (after the model file, after the
    optimizer, half-way through a file, before our state, before the rename, while rotating, while exporting),
    plus SIGTERM/SIGUSR1 and Ctrl-C (once: a checkpoint after the step, exit 130; twice, the second inside the
    save: exit 130 at once, that checkpoint never in view); each resume takes the newest complete checkpoint and
    ends on the uninterrupted weights."""
    _, stderr = run_fault_trials("survival_driver.py", base, TRIALS, _env())
    assert len(TRIALS) >= 20
    # what each Ctrl-C said, in one line each
    assert "prefixdpo train: interrupted (Ctrl-C) at step 4 of 12: checkpoint saved to" in stderr
    assert "prefixdpo train: stopped at once by Ctrl-C" in stderr


def test_ctrl_c_once_and_twice_in_a_reward_model_run(tmp_path_factory, base):
    """(~25 s) `prefixdpo reward`, as `train`: a first Ctrl-C at step 4 saves that step's checkpoint (exit 130), a
    second one inside the save stops at once with checkpoint-3 the newest in view; both resume exactly."""
    work = tmp_path_factory.mktemp("reward-ctrl-c")
    (work / "base").symlink_to(base / "base")
    trials = [{"point": "sigint", "step": 4, "expect": 4}, {"point": "sigint_twice", "step": 5, "expect": 3}]
    _, stderr = run_fault_trials("survival_driver.py", work, trials, _env(), "reward")
    assert "prefixdpo reward: interrupted (Ctrl-C) at step 4 of 12" in stderr
    assert "prefixdpo reward: stopped at once by Ctrl-C" in stderr


def _train(base: Path, out: Path, *extra: str) -> int:
    return main(["train", "--model", str(base / "base" / "model"), "--dataset", str(base / "base" / "train.jsonl"),
                 "--output_dir", str(out), "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
                 "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--bf16", "false",
                 "--gradient_checkpointing", "false", "--disable_tqdm", "true", "--report_to", "none", *extra])


def test_output_dir_of_another_run_is_refused_and_overwrite_replaces_it(base, capsys):
    out = base / "other-run"
    assert _train(base, out, "--beta", "0.1") == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert _train(base, out, "--beta", "0.2") == 2  # other options: another run
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds another run" in err[0] and "beta 0.1 -> 0.2" in err[0], err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing overwritten
    # max_steps and logging may change on resume: still this run
    assert _train(base, out, "--beta", "0.1", "--max_steps", "6", "--logging_steps", "3",
                  "--resume_from_checkpoint", "latest") == 0
    assert _train(base, out, "--beta", "0.2", "--overwrite_output_dir", "true") == 0
    state = checkpoints.read_state(str(out / "checkpoint-4"))
    assert state["run"]["options"]["beta"] == 0.2
    assert not (out / "checkpoint-6").exists()  # the other run's checkpoints are gone


def test_latest_skips_incomplete_and_refuses_foreign_checkpoints(base, capsys):
    out = base / "torn"
    assert _train(base, out) == 0
    # a checkpoint torn by a tool that writes in place: a truncated model file
    model_file = out / "checkpoint-4" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:100])
    capsys.readouterr()
    assert _train(base, out, "--resume_from_checkpoint", "latest", "--max_steps", "6") == 0
    printed = capsys.readouterr().out
    assert "skipped" in printed and "checkpoint-4" in printed and "model.safetensors holds 100 bytes" in printed
    # a checkpoint of another run placed under a newer step number: refused in one line, not resumed
    (out / "checkpoint-6").rename(out / "checkpoint-9")
    state_file = out / "checkpoint-9" / checkpoints.STATE_FILE
    state = json.loads(state_file.read_text())
    state["run"]["data"] = "0" * 64
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    assert _train(base, out, "--resume_from_checkpoint", "latest", "--max_steps", "12") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "another run" in line and "checkpoint-9" in line and "training data" in line


def test_preempted_two_rank_torchrun_saves_exits_nonzero_and_resumes_exactly(base):
    """SIGTERM to torchrun at a random step: both ranks finish that optimizer step, one complete checkpoint with
    our state is saved, the exit code is not 0 and nothing is exported; resuming equals an uninterrupted run."""
    import random

    from safetensors.torch import load_file

    def launch(out, *extra):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                "prefixdpo.cli", "train", "--model", str(base / "base" / "model"),
                "--dataset", str(base / "base" / "train.jsonl"), "--output_dir", str(out), "--max_steps", "40",
                "--save_strategy", "steps", "--save_steps", "100", "--per_device_train_batch_size", "2",
                "--learning_rate", "1e-3", "--optim", "adamw_torch", "--bf16", "false", "--logging_steps", "1",
                "--gradient_checkpointing", "false", "--disable_tqdm", "true", "--report_to", "none", *extra]
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    reference = launch(base / "ddp-reference")  # no --use_cpu: torchrun without a GPU still makes one 2-process job
    out, err = reference.communicate(timeout=600)
    assert reference.returncode == 0, err[-3000:]
    assert "Engine: MULTI_CPU over 2 processes" in out
    stop_after = random.Random().randint(3, 25)
    out, err, step = preempt_after(launch(base / "ddp-preempted"), "{'loss'", stop_after)
    assert stop_after <= step < 40
    folder = base / "ddp-preempted" / f"checkpoint-{step}"
    assert checkpoints.checkpoint_problem(str(folder), None) is None  # complete, with our state
    assert "Model saved" not in out and not (base / "ddp-preempted" / "model.safetensors").exists()
    resumed = launch(base / "ddp-preempted", "--resume_from_checkpoint", "latest")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-3000:]
    expected = load_file(str(base / "ddp-reference" / "model.safetensors"))
    got = load_file(str(base / "ddp-preempted" / "model.safetensors"))
    assert_same_weights(got, expected, what="preempted and resumed vs uninterrupted")
    assert all(torch.isfinite(v).all() for v in got.values())


def test_ctrl_c_to_the_command_finishes_the_step_saves_and_exits_130(base):
    """(~20 s) A real Ctrl-C (SIGINT from outside) to `prefixdpo train` after its 3rd logged step: it says at once
    that it finishes the step, saves a complete checkpoint of that step, exports nothing, ends with one line naming
    the checkpoint and the resume option, exit 130; `--resume_from_checkpoint latest` then finishes the run."""
    def launch(out, *extra):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        argv = [sys.executable, "-m", "prefixdpo.cli", "train", "--model", str(base / "base" / "model"),
                "--dataset", str(base / "base" / "train.jsonl"), "--output_dir", str(out), "--max_steps", "30",
                "--save_strategy", "steps", "--save_steps", "100", "--per_device_train_batch_size", "2",
                "--learning_rate", "1e-3", "--bf16", "false", "--logging_steps", "1", "--gradient_checkpointing",
                "false", "--disable_tqdm", "true", "--report_to", "none", *extra]
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    out_dir = base / "ctrl-c"
    process = launch(out_dir)
    out, err, step = preempt_after(process, "{'loss'", 3, sig=signal.SIGINT, said="interrupted (Ctrl-C) at step ")
    assert process.returncode == 130, err[-3000:]
    assert 3 <= step < 30
    assert "Ctrl-C: finishing this optimizer step, then saving a checkpoint" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"prefixdpo train: interrupted (Ctrl-C) at step {step} of 30: checkpoint saved to ")
    assert last.endswith("resume with --resume_from_checkpoint latest") and "Traceback" not in err
    assert checkpoints.checkpoint_problem(str(out_dir / f"checkpoint-{step}"), None) is None
    assert "Model saved" not in out and not (out_dir / "model.safetensors").exists()
    resumed = launch(out_dir, "--resume_from_checkpoint", "latest")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert (out_dir / "model.safetensors").exists()
