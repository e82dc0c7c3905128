"""GRPO/RLOO runs survive as DPO runs do (`training.survival.SurvivingRun`): a run killed inside a save, or
preempted, loses at most the work since its last complete checkpoint and resumes to the weights of an
uninterrupted run; an output_dir of another run is refused; a NaN step is never applied.

Faults are injected (SIGKILL inside the save's stages, SIGTERM to the command, a NaN added to TRL's loss), never
reasoned about. Times on 2 shared cores (one torch thread): see each test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import preempt_after, run_fault_trials
from transformers import TrainerCallback

from prefixdpo.cli import main
from prefixdpo.core.model_checks import unwrap
from prefixdpo.training import checkpoints
from prefixdpo.training.nonfinite import NonFiniteLossError
from tolerances import assert_same_weights

HERE = Path(__file__).resolve().parent

# (fault point, step) -> the newest complete checkpoint when it strikes (6 steps, save_steps 2, limit 2). GRPO runs the
# same `SurvivingRun` as DPO, whose test_survival.py kills at every point; here one torn file, one missing state file
# and a preemption show the GRPO trainer goes through it.
TRIALS = [
    {"point": "mid_optimizer_file", "step": 4, "expect": 2},
    {"point": "before_our_state", "step": 6, "expect": 4},
    {"point": "sigterm", "step": 3, "expect": 3},  # preempted: a checkpoint at that step, exit 75
    {"point": "sigint_twice", "step": 5, "expect": 4},  # the second Ctrl-C inside step 5's save: 5 never in view
]


# stderr holds exactly what a command writes: transformers' loading bars off (conftest.no_progress_bars)
pytestmark = pytest.mark.usefixtures("no_progress_bars")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny model (with its tokenizer) and 4 prompts: 6 steps of one prompt x 4 completions cross an epoch."""
    from grpo_common import prompt_dataset, saved_tiny_model, tokenizer

    folder = tmp_path_factory.mktemp("grpo-survival")
    model_dir = saved_tiny_model(folder / "model")
    tokenizer().save_pretrained(model_dir)
    prompt_dataset(4).to_json(str(folder / "prompts.jsonl"))
    return folder


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def test_kill_inside_a_save_resumes_from_the_previous_complete_checkpoint(work):
    """4 trials (~35 s): SIGKILL half-way through optimizer.pt and before our state file, SIGTERM, and Ctrl-C twice
    (the second inside the preemption's save); each resume with `latest` takes the newest complete checkpoint and
    ends on the uninterrupted run's weights (sampling included: TRL's seeded sampler and the torch RNG state
    Trainer saves in each checkpoint)."""
    _, stderr = run_fault_trials("grpo_survival_driver.py", work, TRIALS, _env())
    assert "prefixdpo grpo: stopped at once by Ctrl-C" in stderr


def test_ctrl_c_in_an_rloo_run_saves_the_step_and_resumes_exactly(tmp_path_factory, work):
    """(~15 s) `prefixdpo rloo`: a first Ctrl-C at step 3 saves that step's checkpoint, exit 130; the resume ends
    on the uninterrupted run's weights."""
    folder = tmp_path_factory.mktemp("rloo-ctrl-c")
    for name in ("model", "prompts.jsonl"):
        (folder / name).symlink_to(work / name)
    _, stderr = run_fault_trials("grpo_survival_driver.py", folder, [{"point": "sigint", "step": 3, "expect": 3}],
                                 _env(), "rloo")
    assert "prefixdpo rloo: interrupted (Ctrl-C) at step 3 of 6: checkpoint saved to" in stderr


def _grpo(work: Path, out: Path, *extra: str) -> list[str]:
    return ["grpo", "--model", str(work / "model"), "--dataset", str(work / "prompts.jsonl"), "--reward_funcs",
            "prefixdpo_tools.demo_grpo:vowel_share", "--num_generations", "4", "--per_device_train_batch_size", "4",
            "--max_completion_length", "8", "--learning_rate", "1e-2", "--seed", "3", "--logging_steps", "1",
            "--disable_tqdm", "true", "--report_to", "none", "--output-dir", str(out), *extra]


def test_output_dir_of_another_run_is_refused_in_one_line(work, capsys):
    """(~10 s) Another beta, or other prompts, in the same output_dir: refused (exit 2, one line), nothing
    touched; overwrite_output_dir replaces it."""
    torch.set_num_threads(1)
    out = work / "other-run"
    steps = ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1"]
    assert main(_grpo(work, out, *steps)) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert main(_grpo(work, out, *steps, "--epsilon", "0.3")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds another run" in err[0] and "epsilon 0.2 -> 0.3" in err[0], err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing overwritten
    other_prompts = work / "other.jsonl"
    other_prompts.write_text('{"prompt": "something else"}\n' * 4)
    argv = _grpo(work, out, *steps)
    argv[argv.index(str(work / "prompts.jsonl"))] = str(other_prompts)
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "holds another run" in line and "training data" in line
    assert main(_grpo(work, out, *steps, "--epsilon", "0.3", "--overwrite_output_dir", "true")) == 0
    assert checkpoints.read_state(str(out / "checkpoint-2"))["run"]["options"]["epsilon"] == 0.3


def test_preempted_two_rank_torchrun_saves_exits_non_zero_and_resumes_exactly(work):
    """(~2.5 min) SIGTERM to torchrun (2 gloo ranks) after the 3rd logged step: both ranks finish that optimizer
    step, one complete checkpoint is saved, torchrun exits non-zero, nothing is exported; the resume ends on the
    weights of an uninterrupted 2-rank run."""

    def launch(out, *extra):
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                "prefixdpo.cli", *_grpo(work, out, "--max_steps", "8", "--save_strategy", "steps", "--save_steps",
                                        "100", *extra)]
        return subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    reference = launch(work / "ddp-reference")
    out, err = reference.communicate(timeout=600)
    assert reference.returncode == 0, err[-3000:]
    out, err, step = preempt_after(launch(work / "ddp-preempted"), "step ", 3)
    assert 3 <= step < 8
    folder = work / "ddp-preempted" / f"checkpoint-{step}"
    assert checkpoints.checkpoint_problem(str(folder), None) is None
    assert "Model saved" not in out and not (work / "ddp-preempted" / "model.safetensors").exists()
    resumed = launch(work / "ddp-preempted", "--resume_from_checkpoint", "latest")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    expected = load_file(str(work / "ddp-reference" / "model.safetensors"))
    got = load_file(str(work / "ddp-preempted" / "model.safetensors"))
    assert_same_weights(got, expected, what="preempted and resumed vs uninterrupted")


# ---- a NaN step -------------------------------------------------------------------------------------


class Snapshots(TrainerCallback):
    """Weights, AdamW state and lr-scheduler position at the end of every optimizer step."""

    def __init__(self):
        self.trainer, self.at = None, {}

    def on_step_end(self, args, state, control, model=None, **kw):
        opt = self.trainer.optimizer.optimizer
        moments = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        self.at[state.global_step] = ({k: v.detach().clone() for k, v in unwrap(model).named_parameters()},
                                      moments, self.trainer.lr_scheduler.last_epoch)


def _nan_trainer(trainer_class, step: int):
    """`trainer_class` whose loss (TRL's own `_compute_loss`) has a NaN added at optimizer step `step`."""

    class NanLoss(trainer_class):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            return loss + float("nan") if self.state.global_step + 1 == step else loss

    return NanLoss


def _trainer(kind: str, tmp_path, step: int, **options):
    from grpo_common import prompt_dataset, reward_vowels, tiny_causal_lm, tokenizer

    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer, PrefixRLOOConfig, PrefixRLOOTrainer

    trainer_class, config_class = ((PrefixGRPOTrainer, PrefixGRPOConfig) if kind == "grpo"
                                   else (PrefixRLOOTrainer, PrefixRLOOConfig))
    args = config_class(output_dir=str(tmp_path / kind), per_device_train_batch_size=4, num_generations=4,
                        max_completion_length=8, max_steps=4, learning_rate=1e-2, optim="adamw_torch",
                        lr_scheduler_type="constant_with_warmup", warmup_steps=2, logging_steps=1, seed=0,
                        use_cpu=True, report_to="none", disable_tqdm=True, beta=0.0, **options)
    snapshots = Snapshots()
    trainer = _nan_trainer(trainer_class, step)(model=tiny_causal_lm(), reward_funcs=reward_vowels, args=args,
                                                train_dataset=prompt_dataset(8), processing_class=tokenizer(),
                                                callbacks=[snapshots])
    snapshots.trainer = trainer
    return trainer, snapshots


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_nan_loss_stops_before_it_is_applied_by_default(kind, tmp_path):
    """(~5 s each) nonfinite=stop (the default): the run stops at step 3 naming it and the last good checkpoint;
    the weights are those of step 2 exactly (the NaN step never reached them)."""
    torch.set_num_threads(1)
    trainer, snapshots = _trainer(kind, tmp_path, 3, save_strategy="steps", save_steps=1)
    # the poisoned loss (`nonfinite.poisoned`) makes the gradient norm NaN as well
    with pytest.raises(NonFiniteLossError, match="^optimizer step 3: the loss of a micro-batch was nan and the "
                                                 "gradient norm was not finite; stopped before applying it") as err:
        trainer.train()
    now = {k: v.detach() for k, v in unwrap(trainer.model).named_parameters()}
    step2, step1 = snapshots.at[2][0], snapshots.at[1][0]
    assert max(float((now[k] - step2[k]).abs().max()) for k in now) == 0.0
    assert max(float((step2[k] - step1[k]).abs().max()) for k in now) > 0  # the steps before did train
    out = Path(trainer.args.output_dir)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert f"Last good checkpoint: {out / 'checkpoint-2'}." in str(err.value)


def test_nan_loss_is_skipped_and_counted_with_skip(tmp_path):
    """(~5 s) nonfinite=skip: step 2's weights, AdamW state and lr-schedule position equal step 1's; the run
    goes on (steps 3-4 train) and logs nonfinite_skipped."""
    torch.set_num_threads(1)
    trainer, snapshots = _trainer("grpo", tmp_path, 2, nonfinite="skip")
    trainer.train()
    assert trainer.state.global_step == 4
    (w1, opt1, lr1), (w2, opt2, lr2) = snapshots.at[1], snapshots.at[2]
    assert max(float((w2[k] - w1[k]).abs().max()) for k in w1) == 0.0
    assert len(opt1) == len(opt2) > 0 and all(torch.equal(a, b) for a, b in zip(opt1, opt2))
    assert lr2 == lr1
    w4 = snapshots.at[4][0]
    assert max(float((w4[k] - w2[k]).abs().max()) for k in w2) > 0
    assert all(torch.isfinite(v).all() for v in w4.values())
    assert [h["nonfinite_skipped"] for h in trainer.state.log_history if "loss" in h] == [0, 1, 1, 1]
    assert trainer.state.log_history[-1]["nonfinite_skipped"] == 1


def test_epoch_sampler_repeats_trls_order_and_resumes_it():
    """(<1 s) `EpochRepeatSampler` yields TRL's `RepeatSampler` order in every epoch of a run, and a fresh one set
    to epoch e (a resumed run) yields epoch e's order (TRL's own would yield epoch 0's again)."""
    from trl.trainer.utils import RepeatSampler

    from prefixdpo.grpo.trainer import EpochRepeatSampler

    def make(cls):
        return cls(list(range(10)), mini_repeat_count=3, batch_size=4, repeat_count=2, shuffle=True, seed=7)

    trl = make(RepeatSampler)
    trl_epochs = [list(trl) for _ in range(4)]
    assert len({tuple(e) for e in trl_epochs}) == 4  # the order changes per epoch
    ours = make(EpochRepeatSampler)
    epochs = []
    for epoch in range(4):
        ours.set_epoch(epoch)
        epochs.append(list(ours))
    assert epochs == trl_epochs
    resumed = make(EpochRepeatSampler)
    resumed.set_epoch(2)
    assert list(resumed) == trl_epochs[2]
    assert list(make(RepeatSampler)) != trl_epochs[2]  # what TRL's sampler gives a run resumed in epoch 2


def test_num_iterations_2_resumes_exactly_at_a_cycle_boundary_and_says_so_inside_one(tmp_path, caplog):
    """(~6 s) num_iterations=2 (each generation serves two optimizer steps): resumed from checkpoint-2 (a cycle
    boundary) the run ends on the uninterrupted run's weights; resumed from checkpoint-1 (inside a cycle, whose
    completions TRL kept in memory only) it finishes and says once that it generated the rest anew."""
    from grpo_common import prompt_dataset, reward_vowels, tiny_causal_lm, tokenizer

    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer

    torch.set_num_threads(1)

    def trainer(out: str, max_steps: int):
        args = PrefixGRPOConfig(output_dir=str(tmp_path / out), per_device_train_batch_size=4, num_generations=4,
                                max_completion_length=8, max_steps=max_steps, num_iterations=2, learning_rate=1e-2,
                                lr_scheduler_type="constant",  # the 2-step run then trains as the 4-step one
                                logging_steps=1, seed=0, use_cpu=True, report_to="none", disable_tqdm=True,
                                save_strategy="steps", save_steps=1)
        torch.manual_seed(0)
        return PrefixGRPOTrainer(model=tiny_causal_lm(), reward_funcs=reward_vowels, args=args,
                                 train_dataset=prompt_dataset(4), processing_class=tokenizer())

    def weights(t):
        return {k: v.detach().clone() for k, v in unwrap(t.model).named_parameters()}

    whole = trainer("whole", 4)
    whole.train()
    short = trainer("short", 2)
    short.train()
    caplog.clear()
    resumed = trainer("short", 4)
    resumed.train(resume_from_checkpoint="latest")
    assert not [r for r in caplog.records if "generation cycle" in r.getMessage()]
    a, b = weights(whole), weights(resumed)
    assert_same_weights(b, a, what="resumed vs whole")
    inside = trainer("short", 4)
    inside.train(resume_from_checkpoint=str(tmp_path / "short" / "checkpoint-1"))
    said = [r.getMessage() for r in caplog.records if "generation cycle" in r.getMessage()]
    assert len(said) == 1 and "micro-step 1 of every 2" in said[0], said
    assert inside.state.global_step == 4
