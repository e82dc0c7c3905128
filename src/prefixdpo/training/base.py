"""What every prefixdpo trainer adds to `transformers.Trainer`, whatever it trains (DPO family, reward model).

- data: each loader item is one micro-batch (padded or packed lines), planned per epoch with the seed, the
  same number of micro-batches on every rank (`data/loader.py`), re-planned by `RunCallback`; with
  `group_by_prompt`, the examples of one prompt are first merged into one (`data/grouping.py`);
- gradient normalisation: a micro-batch's loss is ``sum(pair losses) * W / N``, N the pairs of the whole
  optimizer step over all W ranks (known from the plan, no communication). The engines average gradients
  over ranks (the W cancels) and `loss_is_scaled_for_ga = True` stops Trainer from dividing by the
  accumulation steps again: every step's gradient is that of the mean pair loss of the step;
- evaluation weighs every pair equally (Trainer's loop would concatenate logits per batch);
- logging: pairs (not micro-batches) as samples, the subclass's metric sums reduced over ranks;
- engines: a requested FSDP applied (also on CPU) or refused (`engines.py`); an export is always a whole
  model that stock `from_pretrained` loads;
- runs that survive (`checkpoints.py`): every checkpoint is staged and renamed into view complete, with our
  state and the run's fingerprint; `resume_from_checkpoint="latest"` takes the newest complete checkpoint of
  this run; an output_dir holding another run is refused; SIGTERM/SIGUSR1 end the optimizer step, save a
  checkpoint and raise `TrainingPreempted`. Every such decision is taken on rank 0 and broadcast.
- non-finite steps: every micro-batch's loss and the step's gradient norm go to `nonfinite.NonFiniteGuard`,
  which stops or skips a step that is not finite on some rank before it is applied (`nonfinite`).

Each loader item is a `data.loader.MicroBatch`, never changed once built: Trainer hands it to `compute_loss` as
it is (`_prepare_inputs`), or, where a method works something out per optimizer step, wrapped in that method's
per-step object (`_micro_batch` reads the MicroBatch back out of it).

A subclass provides `_as_examples` (records -> Examples), `_pair_step` (one micro-batch's losses and metric
sums), `compute_loss`, and `_new_metric_sums`; optionally `_reference_table`, `_micro_batch`, and its
per-checkpoint state (`_checkpoint_state` / `_restore_checkpoint_state`).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping

import torch
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

from prefixdpo.training import checkpoints
from prefixdpo.training.callbacks import RunCallback
from prefixdpo.atomic_io import atomic_write_json, move_files_into
from prefixdpo.core.attention.backends import resolve_backend
from prefixdpo.data.grouping import GroupReport, group_by_prompt
from prefixdpo.data.loader import LoaderSettings, MicroBatch, MicroBatches, make_dataloader
from prefixdpo.core.engines import enable_requested_fsdp, refuse_unsupported_engine_options, whole_model_state_dict
from prefixdpo.errors import TrainingPreempted, UserError
from prefixdpo.core.model_checks import restore_stock_attention, unwrap
from prefixdpo.rank_decisions import from_rank0
from prefixdpo.training.nonfinite import NonFiniteGuard, check_engine_support, poisoned
from prefixdpo.core.offloading import activation_offloading_context
from prefixdpo.data.inputs import loader_settings, pad_token_id


class PrefixTrainerBase(Trainer):
    """`transformers.Trainer` over prefix-shared micro-batches of preference pairs (see the module docstring)."""

    # compute_loss already divides by the step's pair count
    loss_is_scaled_for_ga = True

    # ---- construction -----------------------------------------------------------------------

    def _checked_args(self, args, config_class):
        """`args` (default: `config_class()`) after checking its type; picks the attention backend once, for
        every pass of the run."""
        args = args if args is not None else config_class()
        if not isinstance(args, config_class):
            raise TypeError(f"args must be a {config_class.__name__}")
        self.backend = resolve_backend(args.attention, args.device, needs_grad=True)
        logging.getLogger(__name__).info("attention backend: %s (attention=%s)", self.backend, args.attention)
        return args

    def _examples_of(self, train_dataset, eval_dataset, tokenizer, args):
        """(train Examples, eval Examples or a dict of them) through the subclass's `_as_examples`, grouped by
        prompt when `args.group_by_prompt`."""
        self.group_reports: dict[str, GroupReport] = {}
        train = self._grouped(self._as_examples(train_dataset, tokenizer, "train"), "train", args)
        if isinstance(eval_dataset, Mapping):
            return train, {key: self._grouped(self._as_examples(data, tokenizer, f"eval_{key}"), f"eval_{key}", args)
                           for key, data in eval_dataset.items()}
        return train, self._grouped(self._as_examples(eval_dataset, tokenizer, "eval"), "eval", args)

    def _grouped(self, examples, name: str, args):
        """`examples` with records of the same prompt merged (`data.grouping`) when `args.group_by_prompt`; the
        report goes to `self.group_reports[name]` and the log. A merged row is kept to an explicit pack length."""
        if examples is None or not args.group_by_prompt:
            return examples
        limit = args.pack_length if args.packing and isinstance(args.pack_length, int) else None
        grouped, report = group_by_prompt(examples, max_row_length=limit)
        self.group_reports[name] = report
        logging.getLogger(__name__).info("%s: %s", name, report.summary())
        return grouped

    def _init_run_state(self) -> None:
        """Per-run state, after `Trainer.__init__` (the model is in place)."""
        self._offload = activation_offloading_context(self.model, self.args.activation_offloading)
        self._metrics = {"train": self._new_metric_sums(), "eval": self._new_metric_sums()}
        self._pairs_trained = 0.0
        self.nonfinite = NonFiniteGuard(self.args.nonfinite, self.args.nonfinite_max_consecutive)
        self._train_micro: MicroBatches | None = None
        self.engine_description = "not started"  # set when training begins (`engines.describe_engine`)
        self.run_fingerprint: dict | None = None  # set by `train` (`checkpoints.run_fingerprint`)
        self.preempted_at: int | None = None  # the optimizer step after which a preemption signal stopped the run
        drop_transformers_jit_checkpoint(self)  # our preemption handling replaces it (`callbacks.py`)
        self.run_callback = RunCallback(self)
        self.add_callback(self.run_callback)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        enable_requested_fsdp(self)  # accelerate drops a requested FSDP on CPU: apply it, or refuse
        refuse_unsupported_engine_options(self)
        check_engine_support(self)  # nonfinite=stop/skip holds under this engine, or a one-line refusal

    # ---- data -------------------------------------------------------------------------------

    @property
    def pad_token_id(self) -> int:
        return pad_token_id(self.processing_class)

    def _loader_settings(self, *, train: bool) -> LoaderSettings:
        size = self._train_batch_size if train else self.args.per_device_eval_batch_size
        return loader_settings(self.args, train=train, batch_size=size, pad_token=self.pad_token_id,
                               backend=self.backend)

    def _reference_table(self, examples, name: str):
        """Precomputed per-response reference sums for `examples`, or None (no precomputed reference)."""
        return None

    def _micro_batches(self, examples, *, train: bool, name: str = "train") -> MicroBatches:
        return MicroBatches(examples, self._loader_settings(train=train), rank=self.args.process_index,
                            world_size=self.args.world_size, ref_table=self._reference_table(examples, name))

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise UserError(f"{type(self).__name__}: training needs a train_dataset")
        self._train_micro = self._micro_batches(self.train_dataset, train=True)
        pin = self.args.dataloader_pin_memory and torch.cuda.is_available()  # pinning needs an accelerator
        return make_dataloader(self._train_micro, self.args.dataloader_num_workers, pin)

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is None and self.eval_dataset is None:
            raise UserError(f"{type(self).__name__}: evaluation needs an eval_dataset")
        name = "eval"
        if isinstance(eval_dataset, str):
            name, examples = f"eval_{eval_dataset}", self.eval_dataset[eval_dataset]
        elif eval_dataset is not None:
            examples = self._grouped(self._as_examples(eval_dataset, self.processing_class, "eval"), "eval", self.args)
        else:
            examples = self.eval_dataset
        return make_dataloader(self._micro_batches(examples, train=False, name=name))

    # ---- one step ---------------------------------------------------------------------------

    def _micro_batch(self, inputs) -> MicroBatch:
        """The loader's MicroBatch in what `compute_loss` receives (the MicroBatch itself, unless a subclass's
        `get_batch_samples` wraps it in a per-step object)."""
        return inputs

    def _get_num_items_in_batch(self, batch_samples, device):
        # Trainer would count `labels` to scale the loss; ours is already scaled by the step's pairs (`_step_share`)
        return None

    def _prepare_inputs(self, inputs):
        # Trainer's moves dicts and tensors to the device; a micro-batch moves its Batch itself, in the pass
        return inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self._offload:  # activation_offloading (TRL's context; a no-op when off)
            result = self._compute_loss(model, inputs, return_outputs)
        if return_outputs or not model.training:
            return result
        # A non-finite loss makes every gradient it reaches NaN (a finite one is unchanged), so an engine
        # that checks gradients itself before stepping (DeepSpeed, inside backward) skips this step too.
        return poisoned(result)

    def _step_share(self, inputs) -> float:
        """W / N: what a micro-batch's summed pair losses are multiplied by (module docstring)."""
        return self.accelerator.num_processes / max(self._micro_batch(inputs).step_pairs, 1)

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

    # ---- evaluation and logging -------------------------------------------------------------

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        # `_wrap_model` (private) is how Trainer's own loop gets the DDP/FSDP-wrapped model for inference.
        model = self._wrap_model(self.model, training=False, dataloader=dataloader)
        was_training = model.training
        model.eval()
        sums = self._metrics["eval"] = self._new_metric_sums()
        with torch.no_grad():
            for inputs in dataloader:
                self._pair_step(model, inputs, "eval")
        model.train(was_training)
        pairs = int(sums.reduced(self.accelerator)["pairs"])
        metrics = sums.summary(self.accelerator, prefix=f"{metric_key_prefix}_", with_loss=True)
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=pairs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every rank reaches this point together, so the reduce inside `summary` is safe.
        train = self._metrics["train"]
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            logs = {**logs, **train.summary(self.accelerator), **self._nonfinite_logs()}
            self._pairs_trained += train.last_pairs
        if "train_runtime" in logs:  # Trainer counts micro-batches as samples; a sample here is a pair
            train.summary(self.accelerator)
            self._pairs_trained += train.last_pairs
            logs["train_samples_per_second"] = round(self._pairs_trained / max(logs["train_runtime"], 1e-9), 3)
            logs.update(self._nonfinite_logs())
        super().log(logs, start_time)

    def _nonfinite_logs(self) -> dict[str, int]:
        """`nonfinite_skipped`: optimizer steps skipped so far in the run (nonfinite=skip)."""
        return {"nonfinite_skipped": self.nonfinite.skipped} if self.nonfinite.policy == "skip" else {}

    def floating_point_ops(self, inputs) -> int:
        # 6 x parameters x real tokens (forward + backward), the usual estimate
        return 6 * sum(p.numel() for p in unwrap(self.model).parameters()) * self._micro_batch(inputs).real_tokens

    def _track_num_input_tokens(self, inputs) -> None:
        """`include_num_input_tokens_seen`: every token slot of the lines ("all") or the real tokens
        ("non_padding"), summed over ranks (Trainer's own looks for `input_ids` in a dict)."""
        how = self.args.include_num_input_tokens_seen
        if how == "no":
            return
        micro = self._micro_batch(inputs)
        tokens = torch.tensor(micro.slots if how == "all" else micro.real_tokens, device=self.args.device)
        self.state.num_input_tokens_seen += int(self.accelerator.gather(tokens).sum().item())

    # ---- train / save -----------------------------------------------------------------------

    def _checkpoint_state(self) -> dict:
        """The subclass's own state saved in every checkpoint (JSON-able; none by default)."""
        return {}

    def _restore_checkpoint_state(self, state: dict) -> None:
        """Restore what `_checkpoint_state` saved (none by default)."""

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
            if other and not self.args.overwrite_output_dir:
                raise UserError(f"output_dir {output_dir} holds another run ({other}): choose another --output_dir, "
                                "or pass --overwrite_output_dir true to replace its checkpoints")
            if other:
                removed = checkpoints.clear_other_run(output_dir)
                notes.append(f"overwrite_output_dir: removed another run's {', '.join(removed) or 'run file'}")
            path = resume_from_checkpoint
            if path == "latest":
                point = checkpoints.choose_latest(output_dir, fingerprint)
                notes += [f"skipped {skipped}: {why}" for skipped, why in point.skipped]
                path = point.path
            elif isinstance(path, str):
                checkpoints.check_resume_path(path, fingerprint)
            state = checkpoints.read_state(path) if isinstance(path, str) else None
            return path, state or {}, notes

        resume, state, notes = self._decided_once(decide)
        for note in notes:
            logging.getLogger(__name__).warning("%s", note)
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
        self.run_fingerprint = checkpoints.run_fingerprint(self.model, self.train_dataset or [], self.args,
                                                           type(self).__name__)
        resume_from_checkpoint = self._prepare_output_dir(resume_from_checkpoint)
        self.preempted_at = None
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:  # also when training raises (a non-finite step): SIGTERM ends the process as usual again
            self.run_callback.signals.restore()
        if self.preempted_at is not None:
            folder = os.path.join(self.args.output_dir, f"checkpoint-{self.preempted_at}")
            if not os.path.isdir(folder):  # the signal came after the last step's check: save now
                self._save_checkpoint(self.model, trial=None)
            raise TrainingPreempted(self.preempted_at, self.state.max_steps, folder)
        return output

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
        # `_get_output_dir` is where Trainer's `_save_checkpoint` (and nothing else in it) reads the run folder
        # from; shadowing it on the instance for this one call stages every file Trainer and the engines write.
        # Trainer's own rotation then sees only the staged checkpoint: it is done below, after the rename.
        self._get_output_dir = lambda trial=None: staging
        self.args.save_total_limit = None
        try:
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
            checkpoints.seal_checkpoint(staged, final, {
                "step": step, "run": self.run_fingerprint, "weights_finite": finite,
                "trainer": self._checkpoint_state(), "nonfinite": self.nonfinite.state_dict(),
            })
            shutil.rmtree(staging, ignore_errors=True)
            checkpoints.rotate_checkpoints(run_dir, limit, self.state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()

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

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's save; an export (not a checkpoint) is always a whole, stock-loadable model, staged and
        moved into `output_dir` file by file (each file whole), with the run's fingerprint (`RUN_FILE`) last."""
        folder = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:  # a checkpoint: stays as configured (sharded or not); staged by `_save_checkpoint`
            super().save_model(folder, _internal_call)
            if self.args.should_save:
                restore_stock_attention(folder)
            return
        staging = os.path.join(folder, ".export.staging")
        if self.args.should_save and os.path.isdir(staging):
            shutil.rmtree(staging)
        self.accelerator.wait_for_everyone()
        with whole_model_state_dict(self):
            super().save_model(staging, _internal_call)
        if self.args.should_save:
            restore_stock_attention(staging)  # the saved config names stock attention: loadable without prefixdpo
            if self.run_fingerprint is not None:  # which run wrote this model (`checkpoints.other_run_in`)
                atomic_write_json(os.path.join(staging, checkpoints.RUN_FILE),
                                  {"run": self.run_fingerprint, "step": self.state.global_step})
            move_files_into(staging, folder, last=checkpoints.RUN_FILE)
        self.accelerator.wait_for_everyone()


def drop_transformers_jit_checkpoint(trainer) -> None:
    """Remove transformers' `JITCheckpointCallback` (`--enable_jit_checkpoint`) and put back the SIGTERM
    handler it installed over: prefixdpo always checkpoints on SIGTERM/SIGUSR1, after the optimizer step
    (theirs saves mid-step, without our state, and lets the run end as if finished)."""
    import signal

    for callback in list(trainer.callback_handler.callbacks):
        if type(callback).__name__ == "JITCheckpointCallback":
            manager = getattr(callback, "jit_manager", None)
            if manager is not None and manager._original_sigterm_handler is not None:
                signal.signal(signal.SIGTERM, manager._original_sigterm_handler)
            trainer.callback_handler.remove_callback(callback)
