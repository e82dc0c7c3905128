"""A broken reward function never ends a GRPO/RLOO run as done (`grpo.reward_checks`).

Faults are injected through the command line (`--reward_funcs faulty_rewards:NAME`, tests/faulty_rewards.py):
- a step whose rewards are all None, all NaN, or hold an inf is a non-finite step: `--nonfinite stop` (the default)
  ends with one line naming the step, the function and the last good checkpoint, exit 2, nothing exported, the
  checkpoint of the step before complete and none after it; `--nonfinite skip` skips it (the weights of the
  skipped step are the step before's exactly) and counts it;
- a function that raises or returns something other than one number-or-None per completion stops at once with one
  line naming the function, the step and what it returned (or raised, and where), exit 2;
- a None for some completions keeps TRL's meaning: the run equals TRL's own GRPOTrainer step by step;
- under torchrun, a function raising on one rank stops both ranks with the same line (no rank left waiting).
About 20 s on 2 cores (one torch thread), the 2-rank case ~8 s of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from prefixdpo.cli import main
from prefixdpo.grpo.reward_checks import output_problem, unusable_rewards
from prefixdpo.training import checkpoints

HERE = Path(__file__).resolve().parent

# stderr holds exactly what a command writes: transformers' loading bars off (conftest.no_progress_bars)
pytestmark = pytest.mark.usefixtures("no_progress_bars")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from grpo_common import prompt_dataset, saved_tiny_model, tokenizer

    folder = tmp_path_factory.mktemp("reward-faults")
    tokenizer().save_pretrained(saved_tiny_model(folder / "model"))
    prompt_dataset(4).to_json(str(folder / "prompts.jsonl"))
    return folder


def _command(work: Path, out: Path, reward: str, *extra: str, method: str = "grpo") -> list[str]:
    return [method, "--model", str(work / "model"), "--dataset", str(work / "prompts.jsonl"), "--reward_funcs",
            f"faulty_rewards:{reward}", "--num_generations", "4", "--per_device_train_batch_size", "4",
            "--max_completion_length", "8", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "1",
            "--learning_rate", "1e-2", "--seed", "3", "--logging_steps", "1", "--disable_tqdm", "true",
            "--report_to", "none", "--output-dir", str(out), *extra]


def _run(capsys, argv: list[str]) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr's lines of prefixdpo's own) of the command run in-process."""
    torch.set_num_threads(1)
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.startswith("prefixdpo ")]


def _completes(out: Path) -> list[int]:
    return sorted(int(os.path.basename(p).split("-")[1]) for _, p in checkpoints.checkpoint_folders(str(out))
                  if checkpoints.checkpoint_problem(p, None) is None)


@pytest.mark.parametrize("reward, said", [
    ("all_none_at_3", "reward function 'all_none_at_3' returned None or NaN for all 4 completions"),
    ("all_nan_at_3", "reward function 'all_nan_at_3' returned None or NaN for all 4 completions"),
    ("one_inf_at_3", "reward function 'one_inf_at_3' returned inf for 1 of 4 completions"),
])
def test_a_step_without_usable_rewards_stops_before_it_is_applied(work, tmp_path, capsys, reward, said):
    out = tmp_path / reward
    code, stdout, (line,) = _run(capsys, _command(work, out, reward))
    assert code == 2
    assert line.startswith(f"prefixdpo grpo: error: optimizer step 3: {said}")
    assert f"stopped before applying it (nonfinite=stop). Last good checkpoint: {out / 'checkpoint-2'}" in line
    assert "Model saved" not in stdout and not (out / "model.safetensors").exists()
    assert _completes(out) == [1, 2]


def test_nonfinite_skip_skips_a_step_without_rewards_and_counts_it(work, tmp_path, capsys):
    out = tmp_path / "skip"
    code, stdout, _ = _run(capsys, _command(work, out, "all_none_at_3", "--nonfinite", "skip"))
    assert code == 0 and "Model saved" in stdout
    weights = {step: load_file(str(out / f"checkpoint-{step}" / "model.safetensors")) for step in (2, 3, 4)}
    assert all(torch.equal(weights[3][k], weights[2][k]) for k in weights[2])  # step 3 applied nothing
    assert max(float((weights[4][k] - weights[3][k]).abs().max()) for k in weights[3]) > 1e-4  # step 4 did
    state = checkpoints.read_state(str(out / "checkpoint-4"))
    assert state["nonfinite"]["skipped"] == 1


def test_rloo_stops_on_a_step_without_rewards(work, tmp_path, capsys):
    out = tmp_path / "rloo"
    code, _, (line,) = _run(capsys, _command(work, out, "all_none_at_3", method="rloo"))
    assert code == 2 and line.startswith("prefixdpo rloo: error: optimizer step 3: reward function 'all_none_at_3'")
    assert _completes(out) == [1, 2]


@pytest.mark.parametrize("reward, said", [
    ("returns_none", "reward function 'returns_none' returned None (NoneType), not a list of 4 rewards"),
    ("raises", "reward function 'raises' raised ZeroDivisionError: no completions to divide by "
               "(faulty_rewards.py:"),
])
def test_a_reward_function_breaking_the_contract_stops_in_one_line(work, tmp_path, capsys, reward, said):
    out = tmp_path / reward
    code, stdout, lines = _run(capsys, _command(work, out, reward))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"prefixdpo grpo: error: optimizer step 1: {said}")
    assert lines[0].endswith("stopped, no checkpoint was saved before it")
    assert "Model saved" not in stdout and _completes(out) == []


def test_what_breaks_the_contract_is_named():
    """TRL's contract: one number or None per completion (a list, a tuple, or a 1-D array or tensor)."""
    assert output_problem([0.5, None, 1, True], 4) is None
    assert output_problem(np.array([0.5, 1.0]), 2) is None and output_problem(torch.tensor([0.5, 1.0]), 2) is None
    assert output_problem([torch.tensor(0.5), np.float32(1.0)], 2) is None
    assert output_problem([0.5, 1.0, 2.0], 4).startswith("returned 3 rewards for 4 completions")
    assert output_problem({"reward": 1.0}, 1).startswith("returned {'reward': 1.0} (dict), not a list of 1 rewards")
    assert output_problem([0.5, "0.7"], 2).startswith("returned '0.7' (str) for completion 1")
    assert output_problem([[0.5], [0.7]], 2).startswith("returned [0.5] (list) for completion 0")
    assert output_problem(np.ones((2, 1)), 2).startswith("returned ndarray of shape (2, 1), not a list")
    assert output_problem(0.5, 1).startswith("returned 0.5 (float), not a list of 1 rewards")


def test_which_rewards_are_unusable():
    nan, inf = float("nan"), float("inf")
    names = ["a", "b"]
    assert unusable_rewards(torch.tensor([[nan, 1.0], [nan, 0.0]]), names) is None  # "a" applies to none: TRL's
    assert unusable_rewards(torch.tensor([[nan, 1.0], [0.5, nan]]), names) is None  # each row has a reward
    assert unusable_rewards(torch.tensor([[nan, nan], [nan, nan]]), names) == (
        "every reward function ('a', 'b') returned None or NaN for all 2 completions: no reward to learn from")
    assert unusable_rewards(torch.tensor([[0.0, -inf], [1.0, 0.0]]), names) == (
        "reward function 'b' returned -inf for 1 of 2 completions")


def test_a_reward_of_none_for_some_completions_keeps_trl_meaning(tmp_path):
    """None for every other completion: every logged metric and the final weights equal TRL's GRPOTrainer's over 4
    steps (test_grpo_trl_parity's comparison)."""
    from faulty_rewards import some_none
    from grpo_common import saved_tiny_model
    from test_grpo_trl_parity import compare, run
    from trl import GRPOConfig, GRPOTrainer

    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer

    model_dir = saved_tiny_model(tmp_path / "model")
    options = dict(beta=0.0, num_generations=4, per_device_train_batch_size=4)
    theirs = run(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", reward=some_none, **options)
    ours = run(PrefixGRPOTrainer, PrefixGRPOConfig, model_dir, tmp_path / "ours", reward=some_none, **options)
    compare(theirs, ours)


def test_a_reward_function_raising_on_one_rank_stops_every_rank_in_one_line(work, tmp_path):
    """(~8 s) torchrun, 2 gloo ranks: rank 1's reward function raises at step 1; both ranks stop (no rank waits in
    TRL's gather) with the same one line naming rank 1, torchrun exits non-zero."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
            "prefixdpo.cli", *_command(work, tmp_path / "ddp", "raises_on_rank_1", "--per_device_train_batch_size",
                                       "2")]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = {line for line in proc.stderr.splitlines() if line.startswith("prefixdpo grpo")}  # each rank's, alike
    assert len(lines) == 1, proc.stderr[-3000:]
    (line,) = lines
    assert line.startswith("prefixdpo grpo: error: optimizer step 1: reward function 'raises_on_rank_1' raised "
                           "KeyError: 'answer' (faulty_rewards.py:")
    assert line.endswith(") on rank 1; stopped, no checkpoint was saved before it")
