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
- the run's prefix sharing: one `sharing_run.SharingRun` (`sharing`: the pass backend, the sequence-parallel group
  and the data-parallel rank and world the loaders deal to, prefix reuse's budget), built once after
  `Trainer.__init__` and handed explicitly to what reads it (a method's step);
- engines: a requested FSDP applied (also on CPU) or refused (`engines.py`); an export is always a whole
  model that stock `from_pretrained` loads;
- runs that survive, non-finite steps and exports (`survival.SurvivingRun`, shared with the GRPO/RLOO
  trainers): staged checkpoints sealed with the run's fingerprint, `resume_from_checkpoint="latest"`, another
  run's output_dir refused, SIGTERM/SIGUSR1 -> checkpoint + `TrainingPreempted`, the non-finite guard, staged
  exports. The data fingerprint here is of the training Examples (`_fingerprint_data`).

Each loader item is a `data.loader.MicroBatch`, never changed once built: Trainer hands it to `compute_loss` as
it is (`_prepare_inputs`), or, where a method works something out per optimizer step, wrapped in that method's
per-step object (`_micro_batch` reads the MicroBatch back out of it).

A subclass provides `_as_examples` (records -> Examples), `_pair_step` (one micro-batch's losses and metric
sums), `compute_loss`, and `_new_metric_sums`; optionally `_reference_table`, `_micro_batch`, the options an engine
must refuse (`_whole_weight_options`), and its per-checkpoint state (`_checkpoint_state` /
`_restore_checkpoint_state`). The config reaches `data/` and `core/` only as frozen settings (`settings.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

from prefixdpo.training.callbacks import RunCallback
from prefixdpo.training.metrics import MetricSums
from prefixdpo.training.sharing_run import start_sharing
from prefixdpo.training.survival import SurvivingRun
from prefixdpo.core.fingerprints import data_fingerprint
from prefixdpo.core.fit import check_run_fits
from prefixdpo.core.attention.backends import resolve_backend
from prefixdpo.data.grouping import GroupReport, group_by_prompt
from prefixdpo.data.loader import LoaderSettings, MicroBatch, MicroBatches, make_dataloader
from prefixdpo.errors import UserError
from prefixdpo.core.model_checks import unwrap
from prefixdpo.core.offloading import activation_offloading_context
from prefixdpo.data.inputs import pad_token_id
from prefixdpo.training.settings import apply_engine_settings, fit_settings, loader_settings


class PrefixTrainerBase(SurvivingRun, Trainer):
    """`transformers.Trainer` over prefix-shared micro-batches of preference pairs (see the module docstring)."""

    # compute_loss already divides by the step's pair count
    loss_is_scaled_for_ga = True

    # ---- construction -----------------------------------------------------------------------

    def _checked_args(self, args, config_class) -> tuple:
        """(`args` (default: `config_class()`) after checking its type, the attention backend every pass of the run
        runs, picked once; the model's preparation may still turn it to `STOCK`)."""
        args = args if args is not None else config_class()
        if not isinstance(args, config_class):
            raise TypeError(f"args must be a {config_class.__name__}")
        backend = resolve_backend(args.attention, args.device, needs_grad=True)
        logging.getLogger(__name__).info("attention backend: %s (attention=%s)", backend, args.attention)
        return args, backend

    def _examples_that_fit(self, model, args, backend: str, data_options, train_dataset, eval_dataset, tokenizer,
                           extra_passes=()):
        """(train Examples, eval Examples or a dict of them) of the datasets given (records through the data pipeline
        with `data_options`, reports in `data_reports`), each checked against the model and the machine before any
        work (`core.fit`: positions, the mask's memory in every pass on `backend`, a method's `extra_passes` too)."""
        self._data_options = data_options
        self.data_reports: dict = {}
        train, evals = self._examples_of(train_dataset, eval_dataset, tokenizer, args)
        check_run_fits(model, fit_settings(args, backend, extra_passes), train, evals)
        return train, evals

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

    def _init_run_state(self, backend: str, tokens_per_pass: int | None) -> None:
        """Per-run state, after `Trainer.__init__` (the model is in place): the run's prefix sharing (`sharing`: the
        pass `backend`, prefix reuse's budget `tokens_per_pass`, the sequence-parallel group, checked against the
        model and attached to it), metric sums, the run's callbacks."""
        self._offload = activation_offloading_context(self.model, self.args.activation_offloading)
        self.sharing = start_sharing(self.model, backend, tokens_per_pass=tokens_per_pass,
                                     sequence_parallel_size=getattr(self.args, "sequence_parallel_size", 1),
                                     rank=self.args.process_index, world=self.args.world_size)
        self.sharing.attach(self.model)
        self._metrics = {split: self._counted(self._new_metric_sums()) for split in ("train", "eval")}
        self._pairs_trained = 0.0
        self._train_micro: MicroBatches | None = None
        self.engine_description = "not started"  # set when training begins (`engines.describe_engine`)
        self._init_survival()  # the non-finite guard, preemption, checkpoints of this run (`survival.py`)
        self.run_callback = RunCallback(self)
        self.add_callback(self.run_callback)

    def _counted(self, sums: MetricSums) -> MetricSums:
        """`sums`, counted in the reduce over ranks only on the first rank of each sequence-parallel group
        (`SharingRun.counted`)."""
        sums.counted = self.sharing.counted
        return sums

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        apply_engine_settings(self, self.args.nonfinite, self._whole_weight_options())  # FSDP, ZeRO, nonfinite

    def _whole_weight_options(self) -> tuple[str, ...]:
        """The method's options, set in this run, that read every weight whole (refused under ZeRO-3)."""
        return ()

    # ---- data -------------------------------------------------------------------------------

    @property
    def pad_token_id(self) -> int:
        return pad_token_id(self.processing_class)

    @property
    def train_tree_plan(self):
        """The tries the training data runs as (`prefix_tree`), once training has begun; else None."""
        micro = self._train_micro
        return None if micro is None else micro.tree_plan

    def _loader_settings(self, *, train: bool) -> LoaderSettings:
        size = self._train_batch_size if train else self.args.per_device_eval_batch_size
        return loader_settings(self.args, train=train, batch_size=size, pad_token=self.pad_token_id,
                               backend=self.sharing.backend)

    def _reference_table(self, examples, name: str):
        """Precomputed per-response reference sums for `examples`, or None (no precomputed reference)."""
        return None

    def _micro_batches(self, examples, *, train: bool, name: str = "train") -> MicroBatches:
        # the ranks of a sequence-parallel group run the same micro-batches: the data-parallel rank and world
        return MicroBatches(examples, self._loader_settings(train=train), rank=self.sharing.dp_rank,
                            world_size=self.sharing.dp_world, ref_table=self._reference_table(examples, name))

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
        return self._poisoned_if_training(result, model, return_outputs)

    def _step_share(self, inputs) -> float:
        """W / N: what a micro-batch's summed pair losses are multiplied by (module docstring); M / N with M
        data-parallel groups of sequence-parallel ranks, whose backward already sums each group's ranks
        (`core.sequence_parallel`)."""
        return self.accelerator.num_processes / self.sharing.sp_size / max(self._micro_batch(inputs).step_pairs, 1)

    # ---- evaluation and logging -------------------------------------------------------------

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        # `_wrap_model` (private) is how Trainer's own loop gets the DDP/FSDP-wrapped model for inference.
        model = self._wrap_model(self.model, training=False, dataloader=dataloader)
        was_training = model.training
        model.eval()
        sums = self._metrics["eval"] = self._counted(self._new_metric_sums())
        with torch.no_grad():
            for inputs in dataloader:
                self._pair_step(model, inputs, "eval")
                # as Trainer's own loop: where a signal during training stops the evaluation (`survival`)
                self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        model.train(was_training)
        pairs = int(sums.reduced(self.accelerator)["pairs"])
        metrics = sums.summary(self.accelerator, prefix=f"{metric_key_prefix}_", with_loss=True)
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=pairs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every rank reaches this point together, so the reduce inside `summary` is safe.
        train = self._metrics["train"]
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            logs = {**logs, **train.summary(self.accelerator)}  # nonfinite_skipped: `SurvivingRun.log`
            self._pairs_trained += train.last_pairs
        if "train_runtime" in logs:  # Trainer counts micro-batches as samples; a sample here is a pair
            train.summary(self.accelerator)
            self._pairs_trained += train.last_pairs
            logs["train_samples_per_second"] = round(self._pairs_trained / max(logs["train_runtime"], 1e-9), 3)
        super().log(logs, start_time)

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
        self.state.num_input_tokens_seen += int(self.accelerator.gather(tokens).sum().item()) // self.sharing.sp_size

    # ---- checkpoints --------------------------------------------------------------------------

    def _fingerprint_data(self) -> str:
        return data_fingerprint(self.train_dataset or [])
