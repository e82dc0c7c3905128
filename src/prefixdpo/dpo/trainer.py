"""`PrefixDPOTrainer`: DPO-family training on prefix-shared rows, built on `transformers.Trainer`.

Trainer keeps everything that is not preference-specific (optimizer, schedules, checkpoints and resume,
mixed precision, logging integrations, DDP/FSDP/DeepSpeed); `trainer_base.PrefixTrainerBase` adds what every
prefixdpo trainer shares (micro-batch data, the step's pair normalisation, pair-weighted evaluation,
logging, engines, export). Here:

- the step: `step.DPOStep`, built once with what it reads (the objective, the reference, the run's prefix sharing),
  which the Trainer hooks of one optimizer step call, read top to bottom in `step.py` (the step's micro-batches and
  their context, each micro-batch's passes, losses, metric sums and share);
- the reference: one strategy (`reference.py`, built by `build_reference`), asked only through its methods;
- logging: TRL's metric names, reduced over ranks (`step.DPOMetricSums`).
"""

from __future__ import annotations

from collections.abc import Mapping

from prefixdpo.core.fit import Batches
from prefixdpo.data.inputs import as_examples
from prefixdpo.data.loader import MicroBatch
from prefixdpo.dpo.config import PrefixDPOConfig
from prefixdpo.dpo.config import data_options as default_data_options
from prefixdpo.dpo.reference import build_reference
from prefixdpo.dpo.step import DPOMetricSums, DPOStep, StepInputs
from prefixdpo.training.base import PrefixTrainerBase
from prefixdpo.training.model_setup import prepare_policy
from prefixdpo.training.nonfinite import NonFiniteLossError
from prefixdpo.training.options import resolve_tokens_per_pass

__all__ = ["PrefixDPOTrainer", "NonFiniteLossError"]  # the error is raised by our callback, caught by users


class PrefixDPOTrainer(PrefixTrainerBase):
    """DPO-family preference training with prefix sharing; TRL `DPOTrainer`-shaped constructor.

    model:        a causal LM or its name/path (safetensors; no remote code unless `args.trust_remote_code`).
    ref_model:    a separate frozen reference (model or name); None = the PEFT policy with its adapter off,
                  or a frozen copy of `model`; nothing at all for reference-free losses.
    train_dataset / eval_dataset: a list of `Example`s (used as is), or records / a `datasets.Dataset` / a
                  path, run through `prepare_examples` with `processing_class`; eval may be a dict.
    peft_config:  a `peft` config (e.g. `LoraConfig`) to wrap `model` with.
    """

    def __init__(self, model=None, ref_model=None, args: PrefixDPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, peft_config=None, data_options=None, callbacks=None,
                 optimizers=(None, None)):
        args, backend = self._checked_args(args, PrefixDPOConfig)
        # the pass backend: `STOCK` (the model's own attention) for a model prefix sharing off runs as TRL does
        model, processing_class, backend = prepare_policy(model, args, backend=backend, peft_config=peft_config,
                                                          tokenizer=processing_class)
        tokens_per_pass = resolve_tokens_per_pass(args, model)  # prefix reuse's budget, or None
        precompute = (Batches("reference precompute", "precompute_ref_batch_size", args.precompute_batch_size),)
        train_examples, eval_examples = self._examples_that_fit(
            model, args, backend, data_options or default_data_options(args), train_dataset, eval_dataset,
            processing_class, extra_passes=precompute if args.precompute_ref_log_probs else ())  # must fit too

        super().__init__(model=model, args=args, data_collator=None, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self._init_run_state(backend, tokens_per_pass)
        self.reference = build_reference(args, policy=self.model, ref_model=ref_model, backend=backend,
                                         pad_token_id=self.pad_token_id, accelerator=self.accelerator)
        self.sharing.attach(self.reference.model)  # a separate reference's passes: sharded alike
        self.reference.use_tokens_per_pass(tokens_per_pass)  # its table passes run long examples the same way
        for callback in self.reference.callbacks:  # TR-DPO's sync, when asked for
            self.add_callback(callback)
        # the loss settings and the step's coupling (`step.py`), after the reference
        self.step = DPOStep.of_run(args, self.model, reference=self.reference, sharing=self.sharing,
                                   accelerator=self.accelerator, pad_token_id=self.pad_token_id,
                                   pad_multiple=self._loader_settings(train=True).pad_multiple)
        self.reference.precompute_tables(self._named_datasets(), self.model)  # before training, as TRL does

    def _as_examples(self, data, tokenizer, name: str):
        return as_examples(data, tokenizer, self._data_options, name, self.data_reports)

    def _named_datasets(self) -> list:
        """[(name, examples or None)]: train, then each eval set ("eval", or "eval_<key>" of a dict)."""
        evals = self.eval_dataset if isinstance(self.eval_dataset, Mapping) else {None: self.eval_dataset}
        return [("train", self.train_dataset), *((f"eval_{k}" if k else "eval", v) for k, v in evals.items())]

    def _whole_weight_options(self) -> tuple[str, ...]:
        # under ZeRO-3 a rank holds a partition of each weight: TR-DPO's in-place reference update and a reference
        # table built outside the engine would read it as whole
        return tuple(option for option in ("sync_ref_model", "precompute_ref_log_probs") if getattr(self.args, option))

    @property
    def ref_model(self):
        """The separate reference model run every step, as TRL's attribute (None for other strategies)."""
        return self.reference.model

    @property
    def coupling(self):
        """The step's coupling across pairs (`step.DPOStep.coupling`; read by tests)."""
        return self.step.coupling

    # ---- one optimizer step: Trainer's hooks, each calling the step (`step.py`) ----------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        micro_batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        return self.step.in_step(self.model, micro_batches), None

    def _micro_batch(self, inputs: StepInputs) -> MicroBatch:
        return inputs.micro

    def _new_metric_sums(self) -> DPOMetricSums:
        return DPOMetricSums()

    def _compute_loss(self, model, inputs: StepInputs, return_outputs):
        """The loss Trainer runs backward on: the micro-batch's share of the step's mean pair loss."""
        result, idle_loss = self._pair_step(model, inputs, "train")
        loss = self.step.loss(result, idle_loss, self._step_share(inputs), self.current_gradient_accumulation_steps)
        return (loss, {}) if return_outputs else loss

    def _pair_step(self, model, inputs: StepInputs | MicroBatch, split: str):
        """`DPOStep.pair_step` of this micro-batch, its metric sums added to `split`'s."""
        return self.step.pair_step(model, inputs, split, self._metrics[split])

    # ---- data -------------------------------------------------------------------------------

    def _reference_table(self, examples, name: str):
        return self.reference.table_for(examples, self.model, name)

    # ---- resume -----------------------------------------------------------------------------

    def _checkpoint_state(self) -> dict:
        return self.step.coupling.state_dict()  # e.g. BCO's running mean

    def _restore_checkpoint_state(self, state: dict) -> None:
        self.step.coupling.load_state_dict(state)
