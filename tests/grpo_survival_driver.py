"""Fault trials for tests/test_grpo_survival.py: `prefixdpo grpo` killed (SIGKILL) or preempted (SIGTERM) at chosen
points, then resumed with `--resume_from_checkpoint latest` (the faults of `survival_driver.py`, patched into
`SurvivingRun`, which the GRPO/RLOO trainers share with the DPO ones).

    python tests/grpo_survival_driver.py WORKDIR TRIALS_JSON RESULT_JSON [grpo|rloo]

WORKDIR holds `model/` (a tiny model and its tokenizer) and `prompts.jsonl`. The result file lists, per trial, how
the faulty run ended, the complete checkpoints it left, which one the resume chose, the resume's exit code and the
max |difference| of the final weights to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import sys

import survival_driver as faults  # noqa: E402  (sets one torch thread)

from prefixdpo.training.survival import SurvivingRun  # noqa: E402

faults.gc.collect()  # TRL's trainers, imported since survival_driver froze its imports: frozen too (the same reason)
faults.gc.freeze()

MAX_STEPS = 6
SAVE_STEPS = 2


def command(workdir: str, out: str, resume: bool, method: str = "grpo") -> list[str]:
    argv = [method, "--model", os.path.join(workdir, "model"), "--dataset", os.path.join(workdir, "prompts.jsonl"),
            "--reward_funcs", "prefixdpo_tools.demo_grpo:vowel_share", "--num_generations", "4",
            "--per_device_train_batch_size", "4", "--max_completion_length", "8", "--max_steps", str(MAX_STEPS),
            "--save_strategy", "steps", "--save_steps", str(SAVE_STEPS), "--save_total_limit", "2",
            "--learning_rate", "1e-2", "--lr_scheduler_type", "linear", "--logging_steps", "1", "--seed", "3",
            "--disable_tqdm", "true", "--report_to", "none", "--output-dir", out]
    return argv + (["--resume_from_checkpoint", "latest"] if resume else [])


def main_driver(workdir: str, trials: list[dict], result_path: str, method: str = "grpo") -> None:
    faults.run_trials(workdir, trials, result_path, lambda *a, **kw: command(*a, **kw, method=method),
                      os.path.join(workdir, "model", "model.safetensors"), SurvivingRun)


if __name__ == "__main__":
    main_driver(sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], *sys.argv[4:])
