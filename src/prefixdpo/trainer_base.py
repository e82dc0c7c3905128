"""What every prefixdpo trainer adds to `transformers.Trainer`, whatever it trains (DPO family, reward model).

- data: each loader item is one micro-batch (padded or packed lines), planned per epoch with the seed, the
  same number of micro-batches on every rank (`data/loader.py`), re-planned by `PrefixDPOCallback`;
- gradient normalisation: a micro-batch's loss is ``sum(pair losses) * W / N``, N the pairs of the whole
  optimizer step over all W ranks (known from the plan, no communication). The engines average gradients
  over ranks (the W cancels) and `loss_is_scaled_for_ga = True` stops Trainer from dividing by the
  accumulation steps again: every step's gradient is that of the mean pair loss of the step;
- evaluation weighs every pair equally (Trainer's loop would concatenate logits per batch);
- logging: pairs (not micro-batches) as samples, the subclass's metric sums reduced over ranks;
- engines: a requested FSDP applied (also on CPU) or refused (`engines.py`); an export is always a whole
  model that stock `from_pretrained` loads; `resume_from_checkpoint="latest"`;
- non-finite steps: every micro-batch's loss and the step's gradient norm go to `nonfinite.NonFiniteGuard`,
  which stops or skips a step that is not finite on some rank before it is applied (`nonfinite`).

A subclass provides `_as_examples` (records -> Examples), `_pair_step` (one micro-batch's losses and metric
sums), `compute_loss`, and `_new_metric_sums`; optionally `_reference_table` and `_item_view`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping

import torch
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

from prefixdpo.attention.backends import resolve_backend
from prefixdpo.callbacks import latest_checkpoint, load_state
from prefixdpo.data.loader import LoaderSettings, MicroBatches, make_dataloader
from prefixdpo.engines import enable_requested_fsdp, refuse_unsupported_engine_options, whole_model_state_dict
from prefixdpo.errors import UserError
from prefixdpo.forward import restore_stock_attention, unwrap
from prefixdpo.nonfinite import NonFiniteGuard, check_engine_support, poisoned
from prefixdpo.offloading import activation_offloading_context
from prefixdpo.training_data import loader_settings, pad_token_id


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

    def _examples_of(self, train_dataset, eval_dataset, tokenizer):
        """(train Examples, eval Examples or a dict of them) through the subclass's `_as_examples`."""
        train = self._as_examples(train_dataset, tokenizer, "train")
        if isinstance(eval_dataset, Mapping):
            return train, {key: self._as_examples(data, tokenizer, f"eval_{key}") for key, data in eval_dataset.items()}
        return train, self._as_examples(eval_dataset, tokenizer, "eval")

    def _init_run_state(self) -> None:
        """Per-run state, after `Trainer.__init__` (the model is in place)."""
        self._offload = activation_offloading_context(self.model, self.args.activation_offloading)
        self._metrics = {"train": self._new_metric_sums(), "eval": self._new_metric_sums()}
        self._pairs_trained = 0.0
        self.nonfinite = NonFiniteGuard(self.args.nonfinite, self.args.nonfinite_max_consecutive)
        self._train_micro: MicroBatches | None = None
        self.engine_description = "not started"  # set when training begins (`engines.describe_engine`)

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

    def _item_view(self, micro: MicroBatches):
        """The dataset the loader reads: `micro`, or a view adding fields to each item."""
        return micro

    def _micro_batches(self, examples, *, train: bool, name: str = "train") -> MicroBatches:
        return MicroBatches(examples, self._loader_settings(train=train), rank=self.args.process_index,
                            world_size=self.args.world_size, ref_table=self._reference_table(examples, name))

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise UserError(f"{type(self).__name__}: training needs a train_dataset")
        self._train_micro = self._micro_batches(self.train_dataset, train=True)
        pin = self.args.dataloader_pin_memory and torch.cuda.is_available()  # pinning needs an accelerator
        return make_dataloader(self._item_view(self._train_micro), self.args.dataloader_num_workers, pin)

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is None and self.eval_dataset is None:
            raise UserError(f"{type(self).__name__}: evaluation needs an eval_dataset")
        name = "eval"
        if isinstance(eval_dataset, str):
            name, examples = f"eval_{eval_dataset}", self.eval_dataset[eval_dataset]
        elif eval_dataset is not None:
            examples = self._as_examples(eval_dataset, self.processing_class, "eval")
        else:
            examples = self.eval_dataset
        return make_dataloader(self._item_view(self._micro_batches(examples, train=False, name=name)))

    # ---- one step ---------------------------------------------------------------------------

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
        return self.accelerator.num_processes / max(int(inputs["step_pairs"]), 1)

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
        if not isinstance(inputs, Mapping):
            return 0
        return 6 * sum(p.numel() for p in unwrap(self.model).parameters()) * int(inputs.get("real_tokens", 0))

    # ---- train / save -----------------------------------------------------------------------

    def _load_resume_state(self, checkpoint: str) -> None:
        """Restore our state saved in `checkpoint`: the non-finite counts (a subclass adds its own)."""
        self.nonfinite.load_state_dict(load_state(checkpoint).get("nonfinite", {}))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """Trainer.train; `resume_from_checkpoint="latest"` means the newest checkpoint in output_dir."""
        if resume_from_checkpoint == "latest":
            resume_from_checkpoint = latest_checkpoint(self.args.output_dir)
        if isinstance(resume_from_checkpoint, str):
            self._load_resume_state(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # checkpoints (internal calls) stay as configured; an export is always a whole, stock-loadable model
        with contextlib.nullcontext() if _internal_call else whole_model_state_dict(self):
            super().save_model(output_dir, _internal_call)
        if self.args.should_save:  # the saved config names stock attention: loadable without prefixdpo
            restore_stock_attention(output_dir if output_dir is not None else self.args.output_dir)
