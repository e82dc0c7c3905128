"""Runs that survive, for any `transformers.Trainer` subclass: `SurvivingRun`, mixed in before the Trainer class
(prefixdpo's own trainers through `PrefixTrainerBase`; the GRPO/RLOO trainers over TRL's).

- checkpoints (`checkpoints.py`): every checkpoint is staged in a hidden folder and renamed into view complete,
  sealed with our state file (the run's fingerprint, a manifest of sizes and content digests, whether the weights
  are finite); `resume_from_checkpoint="latest"` takes the newest complete checkpoint of this run whose files
  match their digests and load (`checkpoint_integrity.py`), naming each one it passes over; an output_dir holding
  another run is refused (or cleared with `overwrite_output_dir`); every such decision is taken on rank 0 and
  broadcast;
- full disks (`disk_space.py`): a save that fails for space or I/O is one line naming the checkpoint, the folder,
  the cause and the last complete checkpoint (`SaveFailed`, exit 2), its staging folder removed; a warning at
  start when the output folder has less free space than one checkpoint needs;
- preemption: SIGTERM/SIGUSR1 end the optimizer step, save a checkpoint and raise `TrainingPreempted` (exit 75); a
  first Ctrl-C does the same and raises `TrainingInterrupted` (exit 130), a second one stops at once;
- non-finite steps: every micro-batch's loss and the step's gradient norm go to `nonfinite.NonFiniteGuard`,
  which stops or skips a step that is not finite on some rank before it is applied;
- exports: a whole, stock-loadable model, staged and moved into place file by file, with the run file last.

What a trainer provides: `args` with `options.RunSafetyOptions`' fields (`nonfinite`, `nonfinite_max_consecutive`,
`overwrite_output_dir`; a config without them runs at their defaults, `options.run_safety`), a call to `_init_survival()` after `Trainer.__init__`, and `_fingerprint_data()`
(a digest of its training data: Examples for the preference trainers, prompt rows for GRPO/RLOO). Optionally its
own per-checkpoint state (`_checkpoint_state` / `_restore_checkpoint_state`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import shutil
import signal
import sys
import zipfile

import torch
from safetensors import SafetensorError
from transformers import TrainerCallback

from prefixdpo.atomic_io import atomic_write_json, move_files_into
from prefixdpo.core.engines import whole_model_state_dict
from prefixdpo.core.model_checks import base_model, restore_stock_attention
from prefixdpo.core.stock_attention import stock_implementation
from prefixdpo.errors import TrainingInterrupted, TrainingPreempted, UserError
from prefixdpo.core.rank_decisions import any_rank, from_rank0
from prefixdpo.training import checkpoints, disk_space
from prefixdpo.training.callbacks import PreemptionSignals
from prefixdpo.training.nonfinite import NonFiniteGuard, poisoned
from prefixdpo.training.options import run_safety

logger = logging.getLogger(__name__)


# What loading a checkpoint's files raises when one is corrupt: pickle (optimizer, scheduler, RNG state), zip (a
# torch archive), safetensors (the weights), and RuntimeError, which torch's zip reader raises for a torn archive
# ("PytorchStreamReader failed ..."; `_is_load_error` keeps only those).
LOAD_ERRORS = (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, SafetensorError, RuntimeError)


def _is_load_error(err: BaseException) -> bool:
    """Whether `err`, one of `LOAD_ERRORS`, is a file that does not load (a RuntimeError only if torch's reader's)."""
    return not isinstance(err, RuntimeError) or "PytorchStreamReader" in str(err)


class SaveFailed(UserError):
    """A checkpoint or the model could not be written for space or I/O (a full disk, a quota, a failing device):
    one line naming what, where, why and the last complete checkpoint; exit 2, nothing claimed."""


class EvaluationStopped(Exception):
    """A preemption signal or Ctrl-C reached an evaluation inside training: raised out of the evaluation loop (no
    Trainer control flag stops one midway) and caught by `SurvivingRun.train`, which saves the last completed
    optimizer step and stops; no further step runs."""


class SurvivalCallback(TrainerCallback):
    """Has every optimizer step checked for non-finite values before the optimizer applies it
    (`nonfinite.NonFiniteGuard`), and turns a preemption signal into a checkpoint and a stop after the step (or,
    during an evaluation inside training, at the evaluation's next batch)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.signals = PreemptionSignals()
        self.training = False  # between on_train_begin and on_train_end: signals are ours to act on
        self.stepped = False  # an optimizer step began in this call of train(): later errors are not a resume's

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.trainer.nonfinite.attach(self.trainer)  # nonfinite=skip: the prepared optimizer can skip a step
        self.signals.install()
        self.training = True

    def _stop_now(self, args, state) -> bool:
        """Whether a signal reached any rank (every rank stops after the same step, whichever ranks it reached);
        if so, the step it stops after and whether it was a Ctrl-C anywhere (every rank ends the same way)."""
        if self.trainer.preempted_at is not None or not any_rank(self.signals.received is not None, args.device):
            return False
        self.trainer.preempted_at = state.global_step
        self.trainer.interrupted = any_rank(self.signals.received == signal.SIGINT, args.device)
        return True

    def on_step_begin(self, args, state, control, **kwargs):
        self.stepped = True

    def on_step_end(self, args, state, control, **kwargs):
        if self._stop_now(args, state):
            control.should_save = True  # Trainer saves (a complete checkpoint) right after this hook
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        # a signal after the last step's check still means "stop, not done": `train` saves and raises
        self._stop_now(args, state)
        self.signals.restore()  # from here a SIGTERM ends the process as usual (nothing exported yet)
        self.training = False

    def on_prediction_step(self, args, state, control, **kwargs):
        # After each evaluation batch: a signal (on any rank: every rank runs the same batches) stops the
        # evaluation now rather than after it and one more optimizer step.
        self._stop_evaluation_if_signalled(args, state)

    def on_evaluate(self, args, state, control, **kwargs):
        # a signal after the last batch's check: no further step either
        self._stop_evaluation_if_signalled(args, state)

    def _stop_evaluation_if_signalled(self, args, state) -> None:
        if self.training and (self.trainer.preempted_at is not None or self._stop_now(args, state)):
            raise EvaluationStopped

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # The narrowest public hook that sees a whole step before it is applied: Trainer calls it once per
        # optimizer step, after every micro-batch's backward and the gradient sync, clipping and norm, and
        # right before `optimizer.step()` (DeepSpeed: after its engine step, which skips non-finite steps).
        self.trainer.nonfinite.check(self.trainer, model or self.trainer.model, state.global_step + 1,
                                     functools.partial(checkpoints.last_good_checkpoint, args.output_dir,
                                                       self.trainer.run_fingerprint))


class SurvivingRun:
    """Checkpoints, resume, preemption, non-finite steps and exports that lose nothing (module docstring)."""

    def _init_survival(self) -> None:
        """After `Trainer.__init__`: the guard, the run's (not yet known) fingerprint, the signal handling."""
        safety = run_safety(self.args)
        self.nonfinite = NonFiniteGuard(safety.nonfinite, safety.nonfinite_max_consecutive)
        self.run_fingerprint: dict | None = None  # set by `train` (`checkpoints.run_fingerprint`)
        self.preempted_at: int | None = None  # the optimizer step after which a preemption signal stopped the run
        self.interrupted = False  # ... and whether that signal was a Ctrl-C
        drop_transformers_jit_checkpoint(self)  # our preemption handling replaces it
        self.survival_callback = SurvivalCallback(self)
        self.add_callback(self.survival_callback)

    def _fingerprint_data(self) -> str:
        """A digest of the training data (what makes two runs on other data two runs)."""
        raise NotImplementedError

    def _checkpoint_state(self) -> dict:
        """The trainer's own state saved in every checkpoint (JSON-able; none by default)."""
        return {}

    def _restore_checkpoint_state(self, state: dict) -> None:
        """Restore what `_checkpoint_state` saved (none by default)."""

    # ---- the step ------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        return self._poisoned_if_training(result, model, return_outputs)

    @staticmethod
    def _poisoned_if_training(result, model, return_outputs: bool):
        """A training loss [] made NaN where it is not finite (`nonfinite.poisoned`); anything else as it is."""
        if return_outputs or not model.training:
            return result
        # A non-finite loss makes every gradient it reaches NaN (a finite one is unchanged), so an engine
        # that checks gradients itself before stepping (DeepSpeed, inside backward) skips this step too.
        return poisoned(result)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.nonfinite.note_loss(loss)  # checked with the gradient norm before the optimizer step
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        # Trainer's norm of this step's gradients (global under DDP/FSDP2), the one it logs; Trainer calls
        # this right before `on_pre_optimizer_step`, where the non-finite guard reads it.
        grad_norm = super()._get_grad_norm(model, grad_norm)
        self.nonfinite.note_grad_norm(grad_norm)
        return grad_norm

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if ("loss" in logs and not any(k.startswith("eval_") for k in logs)) or "train_runtime" in logs:
            logs = {**logs, **self._nonfinite_logs()}
        super().log(logs, start_time)

    def _nonfinite_logs(self) -> dict[str, int]:
        """`nonfinite_skipped`: optimizer steps skipped so far in the run (nonfinite=skip)."""
        return {"nonfinite_skipped": self.nonfinite.skipped} if self.nonfinite.policy == "skip" else {}

    # ---- train / resume ------------------------------------------------------------------------

    def _decided_once(self, decide):
        """`decide()` run on rank 0 only and its result (or its UserError) given to every rank, so that no
        rank takes another branch because its disk differs."""
        outcome = None
        if self.accelerator.is_main_process:
            try:
                outcome = ("ok", decide())
            except UserError as err:
                outcome = ("error", str(err))
        outcome = from_rank0(outcome)
        if outcome[0] == "error":
            raise UserError(outcome[1])
        return outcome[1]

    def _prepare_output_dir(self, resume_from_checkpoint):
        """Refuse an output_dir holding another run (or clear it with `overwrite_output_dir`) and resolve
        `resume_from_checkpoint` ('latest' or a path) to a checked checkpoint of this run; rank 0 decides."""
        output_dir = self.args.output_dir
        fingerprint = self.run_fingerprint

        def decide():
            checkpoints.remove_leftovers(output_dir)
            other = checkpoints.other_run_in(output_dir, fingerprint)
            notes = []
            if other and not run_safety(self.args).overwrite_output_dir:
                raise UserError(f"output_dir {output_dir} holds another run ({other}): choose another --output_dir, "
                                "or pass --overwrite_output_dir true to replace its checkpoints")
            if other:
                removed = checkpoints.clear_other_run(output_dir)
                notes.append(f"overwrite_output_dir: removed another run's {', '.join(removed) or 'run file'}")
            path = resume_from_checkpoint
            if path == "latest":
                point = checkpoints.choose_latest(output_dir, fingerprint)
                notes += point.notes()
                path = point.path
            elif isinstance(path, str):
                checkpoints.check_resume_path(path, fingerprint)
            if isinstance(path, str) and (unproven := checkpoints.unproven_note(path)):
                notes.append(unproven)
            state = checkpoints.read_state(path) if isinstance(path, str) else None
            return path, state or {}, notes

        resume, state, notes = self._decided_once(decide)
        for note in notes:
            logger.warning("%s", note)
            if self.accelerator.is_main_process:
                print(f"prefixdpo: {note}", flush=True)
        if isinstance(resume, str):
            self._restore_checkpoint_state(state.get("trainer", {}))
            self.nonfinite.load_state_dict(state.get("nonfinite", {}))
        return resume

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """Trainer.train, with `resume_from_checkpoint="latest"` (the newest complete checkpoint of this run in
        output_dir) and preemption: a SIGTERM/SIGUSR1 ends the current optimizer step, saves a complete
        checkpoint and raises `TrainingPreempted` (the run is not finished: nothing is exported)."""
        self.run_fingerprint = checkpoints.run_fingerprint(self.model, self._fingerprint_data(), self.args,
                                                           type(self).__name__)
        resume_from_checkpoint = self._prepare_output_dir(resume_from_checkpoint)
        self._warn_if_short_of_space()
        self.preempted_at, self.interrupted = None, False
        self.survival_callback.stepped = False
        output = None
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        except EvaluationStopped:  # a signal during an evaluation: `preempted_at` is the last completed step
            pass
        except LOAD_ERRORS as err:
            # Defence in depth: the checkpoint was verified before (digests, structure), so a file that still does
            # not load changed since, or fails in a way the checks cannot see. Before the first step such an
            # error is the checkpoint's, said in one line; later it is a bug and keeps its traceback.
            if (not isinstance(resume_from_checkpoint, str) or self.survival_callback.stepped
                    or not _is_load_error(err)):
                raise
            raise UserError(f"resume_from_checkpoint={resume_from_checkpoint} does not load "
                            f"({type(err).__name__}: {' '.join(str(err).split())[:200]}); resume from an earlier "
                            "checkpoint, or run without --resume_from_checkpoint to start again") from err
        finally:  # also when training raises (a non-finite step): SIGTERM ends the process as usual again
            self.survival_callback.signals.restore()
            self.survival_callback.training = False
        if self.preempted_at is not None:
            folder = os.path.join(self.args.output_dir, f"checkpoint-{self.preempted_at}")
            if not os.path.isdir(folder):  # the signal came after the last step's check: save now
                self._save_checkpoint(self.model, trial=None)
            stopped = TrainingInterrupted if self.interrupted else TrainingPreempted
            raise stopped(self.preempted_at, self.state.max_steps, folder)
        return output

    def _warn_if_short_of_space(self) -> None:
        """One line (first process) when output_dir has less free space than one checkpoint needs, if any will be
        saved (`disk_space.short_space_warning`)."""
        strategy = getattr(self.args.save_strategy, "value", self.args.save_strategy)
        if strategy == "no" or not self.accelerator.is_main_process:
            return
        line = disk_space.short_space_warning(self.args.output_dir, self.model,
                                              bool(getattr(self.args, "save_only_model", False)))
        if line:
            print(f"prefixdpo: {line}", file=sys.stderr, flush=True)

    def evaluate(self, *args, **kwargs):
        """Trainer.evaluate; a Ctrl-C or preemption signal during it (inside training) is said to stop the
        evaluation, which it does at the next batch (`SurvivalCallback.on_prediction_step`)."""
        signals = self.survival_callback.signals
        signals.evaluating = True
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            signals.evaluating = False

    # ---- save ----------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, made complete-or-invisible: every rank writes into a hidden staging folder
        (Trainer's own `_save_checkpoint`, with its output folder pointed there), then rank 0 adds our state
        file last and renames the folder into view; old checkpoints are rotated only after that."""
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        staging = checkpoints.staging_root(run_dir, step)
        if self.args.should_save and os.path.isdir(staging):
            shutil.rmtree(staging)  # a killed earlier attempt at this step
        self.accelerator.wait_for_everyone()
        limit = self.args.save_total_limit
        # `_get_output_dir` is where Trainer's `_save_checkpoint` (and TRL's, for its extra files) reads the run
        # folder from; shadowing it on the instance for this one call stages every file Trainer, TRL and the
        # engines write. Trainer's own rotation then sees only the staged checkpoint: it is done below.
        self._get_output_dir = lambda trial=None: staging
        self.args.save_total_limit = None
        try:
            with self._save_failures_said(f"checkpoint-{step}", run_dir, staging):
                super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
            self.args.save_total_limit = limit
        staged = os.path.join(staging, f"checkpoint-{step}")
        final = os.path.join(run_dir, f"checkpoint-{step}")
        best = self.state.best_model_checkpoint
        if best and os.path.abspath(best) == os.path.abspath(staged):  # Trainer named the staged path
            self.state.best_model_checkpoint = final
            if self.args.should_save:
                self.state.save_to_json(os.path.join(staged, "trainer_state.json"))
        finite = self._weights_finite()
        self.accelerator.wait_for_everyone()  # every rank's shard is on disk
        if self.args.should_save:
            with self._save_failures_said(f"checkpoint-{step}", run_dir, staging):
                checkpoints.seal_checkpoint(staged, final, {
                    "step": step, "run": self.run_fingerprint, "weights_finite": finite,
                    "trainer": self._checkpoint_state(), "nonfinite": self.nonfinite.state_dict(),
                })
            shutil.rmtree(staging, ignore_errors=True)
            checkpoints.rotate_checkpoints(run_dir, limit, self.state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def _save_failures_said(self, what: str, folder: str, staging: str):
        """Turn a failure to write `what` into `folder` for space or I/O into `SaveFailed` (one line: what, where,
        the cause, the last complete checkpoint); its hidden `staging` folder is removed (it would only hold the
        space). Any other error propagates as it is."""
        try:
            yield
        except Exception as err:
            cause = disk_space.save_failure_cause(err, folder)
            if cause is None:
                raise
            shutil.rmtree(staging, ignore_errors=True)
            last = checkpoints.last_good_checkpoint(folder, self.run_fingerprint)
            after = (f"the last complete checkpoint is {last} (free space, then resume with --resume_from_checkpoint "
                     "latest)" if last else "no complete checkpoint was saved before it (free space and run again)")
            raise SaveFailed(f"{what} could not be saved in {folder}: {cause}; {after}") from err

    def _weights_finite(self) -> bool:
        """Whether every weight of the policy is finite on every rank (each rank checks what it holds)."""
        flag = torch.ones((), device=self.args.device)
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)
            if local.numel() and not torch.isfinite(local.detach()).all():
                flag.zero_()
                break
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def _stock_attention(self) -> str:
        """The attention implementation a saved config names (`core.stock_attention.stock_implementation`)."""
        return stock_implementation(base_model(self.model))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's save; an export (not a checkpoint) is always a whole, stock-loadable model, staged and
        moved into `output_dir` file by file (each file whole), with the run's fingerprint (`RUN_FILE`) last."""
        folder = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:  # a checkpoint: stays as configured (sharded or not); staged by `_save_checkpoint`
            super().save_model(folder, _internal_call)
            if self.args.should_save:
                restore_stock_attention(folder, self._stock_attention())
            return
        staging = os.path.join(folder, ".export.staging")
        if self.args.should_save and os.path.isdir(staging):
            shutil.rmtree(staging)
        self.accelerator.wait_for_everyone()
        with self._save_failures_said("the model", folder, staging):
            with whole_model_state_dict(self.accelerator):
                super().save_model(staging, _internal_call)
            if self.args.should_save:
                # the saved config names stock attention: loadable without prefixdpo
                restore_stock_attention(staging, self._stock_attention())
                if self.run_fingerprint is not None:  # which run wrote this model (`checkpoints.other_run_in`)
                    atomic_write_json(os.path.join(staging, checkpoints.RUN_FILE),
                                      {"run": self.run_fingerprint, "step": self.state.global_step})
                move_files_into(staging, folder, last=checkpoints.RUN_FILE)
        self.accelerator.wait_for_everyone()


def drop_transformers_jit_checkpoint(trainer) -> None:
    """Remove transformers' `JITCheckpointCallback` (`--enable_jit_checkpoint`) and put back the SIGTERM
    handler it installed over: prefixdpo always checkpoints on SIGTERM/SIGUSR1, after the optimizer step
    (theirs saves mid-step, without our state, and lets the run end as if finished)."""
    for callback in list(trainer.callback_handler.callbacks):
        if type(callback).__name__ == "JITCheckpointCallback":
            manager = getattr(callback, "jit_manager", None)
            if manager is not None and manager._original_sigterm_handler is not None:
                signal.signal(signal.SIGTERM, manager._original_sigterm_handler)
            trainer.callback_handler.remove_callback(callback)


__all__ = ["SurvivalCallback", "SurvivingRun", "drop_transformers_jit_checkpoint"]
