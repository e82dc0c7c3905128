"""Fault trials for tests/test_survival.py: `prefixdpo train` killed (SIGKILL), preempted (SIGTERM/SIGUSR1) or
interrupted (Ctrl-C, once or twice) at chosen points, then resumed with `--resume_from_checkpoint latest`.

    python tests/survival_driver.py WORKDIR TRIALS_JSON RESULT_JSON [train|reward]

Each trial forks a child that runs the command line in-process with a fault injected by monkeypatching (the
fault is the test's, not the product's), then a second child that resumes. Forking after the imports keeps a
trial at about a second; the driver runs with one thread (OMP_NUM_THREADS=1) so the children inherit no thread
pool. The result file lists, per trial, how the faulty run ended, which checkpoint the resume chose, its exit
code, and the max |difference| of the final weights to an uninterrupted run.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys

import torch

torch.set_num_threads(1)

import safetensors.torch  # noqa: E402
import transformers.modeling_utils  # noqa: E402
from transformers import Trainer  # noqa: E402

from prefixdpo.training import checkpoints  # noqa: E402
from prefixdpo import atomic_io  # noqa: E402
from prefixdpo.cli import main  # noqa: E402
from prefixdpo.training.base import PrefixTrainerBase  # noqa: E402

# The imports' objects live as long as the driver and its forked children: out of the cyclic collector's sight, so
# the `gc.collect()` Trainer runs at the start and end of every run does not walk them (tests/conftest.py).
gc.collect()
gc.freeze()

MAX_STEPS = 12
SAVE_STEPS = 3


def command(workdir: str, out: str, resume: bool, method: str = "train") -> list[str]:
    """`prefixdpo train` (DPO, bco_pair) or `prefixdpo reward` (a Bradley-Terry reward model) on the tiny base."""
    argv = [method, "--model", os.path.join(workdir, "base", "model"),
            "--dataset", os.path.join(workdir, "base", "train.jsonl"), "--output_dir", out,
            "--max_steps", str(MAX_STEPS), "--save_strategy", "steps", "--save_steps", str(SAVE_STEPS),
            "--save_total_limit", "2", "--learning_rate", "3e-3", "--optim", "adamw_torch",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_grad_norm", "1.0",
            "--lr_scheduler_type", "linear", "--logging_steps", "1", "--seed", "3", "--bf16", "false",
            "--gradient_checkpointing", "false", "--disable_tqdm", "true", "--report_to", "none"]
    argv += ["--loss_type", "bco_pair"] if method == "train" else []
    return argv + (["--resume_from_checkpoint", "latest"] if resume else [])


def kill_now() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def inject(point: str, step: int, trainer_class=PrefixTrainerBase) -> None:
    """Patch the child so that it dies (or is signalled) at `point` during optimizer step / save `step`;
    `trainer_class` is the class whose methods are patched (the GRPO trials patch `SurvivingRun`)."""
    def step_of(trainer):
        return trainer.state.global_step

    if point in ("mid_step", "sigterm", "sigusr1", "sigint", "sigint_twice"):
        original = trainer_class.training_step
        sent = {"signal": signal.SIGINT if point.startswith("sigint") else
                signal.SIGTERM if point == "sigterm" else signal.SIGUSR1}

        def training_step(self, *args, **kwargs):
            if step_of(self) == step - 1 and sent:  # inside step `step` (global_step counts finished steps)
                if point == "mid_step":
                    kill_now()
                os.kill(os.getpid(), sent.pop("signal"))  # once (a step has several micro-batches)
            return original(self, *args, **kwargs)

        trainer_class.training_step = training_step
        if point == "sigint_twice":  # the second Ctrl-C while the step's checkpoint is being written
            original_save = trainer_class.save_model

            def save_model(self, output_dir=None, _internal_call=False):
                original_save(self, output_dir, _internal_call)
                if _internal_call and step_of(self) == step:
                    os.kill(os.getpid(), signal.SIGINT)

            trainer_class.save_model = save_model
    elif point == "between_steps":
        original = Trainer._maybe_log_save_evaluate

        def after_step(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if step_of(self) == step:
                kill_now()
            return result

        Trainer._maybe_log_save_evaluate = after_step
    elif point == "after_model_file":
        original = trainer_class.save_model

        def save_model(self, output_dir=None, _internal_call=False):
            original(self, output_dir, _internal_call)
            if _internal_call and step_of(self) == step:
                kill_now()

        trainer_class.save_model = save_model
    elif point == "after_optimizer":
        original = Trainer._save_optimizer_and_scheduler

        def save_optimizer(self, output_dir):
            original(self, output_dir)
            if step_of(self) == step:
                kill_now()

        Trainer._save_optimizer_and_scheduler = save_optimizer
    elif point in ("mid_optimizer_file", "mid_model_file"):
        # half the file's bytes reach the disk, then the process dies
        target = "optimizer.pt" if point == "mid_optimizer_file" else "model.safetensors"
        state = {"trainer": None}
        original_save_ckpt = trainer_class._save_checkpoint

        def save_checkpoint(self, model, trial):
            state["trainer"] = self
            return original_save_ckpt(self, model, trial)

        trainer_class._save_checkpoint = save_checkpoint

        def half_then_die(path):
            data = open(path, "rb").read()
            with open(path, "wb") as fh:
                fh.write(data[: len(data) // 2])
            kill_now()

        if target == "optimizer.pt":
            original_save = torch.save

            def torch_save(obj, f, *args, **kwargs):
                original_save(obj, f, *args, **kwargs)
                if isinstance(f, str) and f.endswith(target) and step_of(state["trainer"]) == step:
                    half_then_die(f)

            torch.save = torch_save
        else:
            original_sf = transformers.modeling_utils.safe_save_file

            def safe_save_file(tensors, filename, *args, **kwargs):
                original_sf(tensors, filename, *args, **kwargs)
                if str(filename).endswith(target) and state["trainer"] is not None \
                        and step_of(state["trainer"]) == step and ".staging" in str(filename):
                    half_then_die(str(filename))

            transformers.modeling_utils.safe_save_file = safe_save_file
            safetensors.torch.save_file = safe_save_file
    elif point == "before_our_state":
        original = checkpoints.seal_checkpoint

        def seal(staged, final, state):
            if state["step"] == step:
                kill_now()
            original(staged, final, state)

        checkpoints.seal_checkpoint = seal
    elif point == "before_rename":
        original = checkpoints.replace_folder

        def replace_folder(tmp_dir, final_dir):
            if final_dir.endswith(f"checkpoint-{step}"):
                kill_now()
            original(tmp_dir, final_dir)

        checkpoints.replace_folder = replace_folder
    elif point == "mid_rotation":
        original = checkpoints.shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if path.endswith(".deleting"):
                kill_now()  # renamed out of view, not yet deleted
            original(path, *args, **kwargs)

        checkpoints.shutil.rmtree = rmtree
    elif point == "mid_export":
        original = atomic_io.os.replace
        moved = {"n": 0}

        def replace(src, dst):
            original(src, dst)
            if ".export.staging" in str(src):
                moved["n"] += 1
                if moved["n"] == 2:  # some of the exported files are in place, the rest are not
                    kill_now()

        atomic_io.os.replace = replace
    else:
        raise ValueError(point)


def run_child(fn) -> int:
    """Run `fn()` in a forked child; its exit code (negative: killed by that signal)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def final_weights(out: str) -> dict:
    return safetensors.torch.load_file(os.path.join(out, "model.safetensors"))


def record_chosen_checkpoint(record: str, trainer_class=PrefixTrainerBase) -> None:
    """Patch `trainer_class` so that the checkpoint a resume chooses is written to the file `record`."""
    original = trainer_class._prepare_output_dir

    def prepare(self, resume):
        chosen = original(self, resume)
        with open(record, "w") as fh:
            json.dump({"chosen": chosen}, fh)
        return chosen

    trainer_class._prepare_output_dir = prepare


def run_trials(workdir: str, trials: list[dict], result_path: str, command, start_weights: str,
               trainer_class=PrefixTrainerBase) -> None:
    """An uninterrupted run of `command(workdir, out, resume)`, then per trial a run with the fault injected into
    `trainer_class` and its resume with `latest`; writes what each ended with to `result_path` (module docstring).
    start_weights: the starting model's safetensors file (how far the uninterrupted run moved the weights)."""
    reference_out = os.path.join(workdir, "reference")
    assert run_child(lambda: main(command(workdir, reference_out, resume=False))) == 0
    reference = final_weights(reference_out)
    start = safetensors.torch.load_file(start_weights)
    moved = max(float((reference[k] - start[k]).abs().max()) for k in reference if k in start)  # a reward model:
    # the causal LM's body
    # the scale the runs' weights carry rounding in (`tolerances.weights_scale`)
    scale = max(float(start[k].abs().max()) for k in reference if k in start) + moved
    results = []
    for i, trial in enumerate(trials):
        out = os.path.join(workdir, f"trial-{i}")

        def faulty(trial=trial, out=out):
            inject(trial["point"], trial["step"], trainer_class)
            return main(command(workdir, out, resume=False))

        faulty_code = run_child(faulty)
        complete = [os.path.basename(p) for _, p in checkpoints.checkpoint_folders(out)
                    if checkpoints.checkpoint_problem(p, None) is None]
        record = os.path.join(workdir, f"chosen-{i}.json")

        def resume(out=out, record=record):  # records which checkpoint `latest` chose
            record_chosen_checkpoint(record, trainer_class)
            return main(command(workdir, out, resume=True))

        resume_code = run_child(resume)
        chosen = json.load(open(record))["chosen"] if os.path.isfile(record) else None
        diff = None
        if resume_code == 0:
            weights = final_weights(out)
            diff = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
        results.append({**trial, "faulty_code": faulty_code, "complete_after_fault": complete,
                        "chosen": os.path.basename(chosen) if chosen else None, "resume_code": resume_code,
                        "max_weight_diff": diff})
    with open(result_path, "w") as fh:
        json.dump({"reference_moved": moved, "weights_scale": scale, "trials": results}, fh, indent=1)


def main_driver(workdir: str, trials: list[dict], result_path: str, method: str = "train") -> None:
    run_trials(workdir, trials, result_path, lambda *a, **kw: command(*a, **kw, method=method),
               os.path.join(workdir, "base", "model", "model.safetensors"))


if __name__ == "__main__":
    main_driver(sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], *sys.argv[4:])
