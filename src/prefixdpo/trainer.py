"""`PrefixDPOTrainer`: DPO-family training on prefix-shared rows, built on `transformers.Trainer`.

Trainer keeps everything that is not preference-specific (optimizer, schedules, checkpoints and resume,
mixed precision, logging integrations, DDP/FSDP/DeepSpeed). We supply:

- data: each loader item is one micro-batch (padded or packed lines), planned per epoch with the seed,
  the same number of micro-batches on every rank (`data/loader.py`); re-planned by `PrefixDPOCallback`;
- `compute_loss`: `step.pair_losses` (policy, reference strategy, losses) for the micro-batch, normalised
  by the pairs of the whole optimizer step;
- evaluation: a pair-weighted loop returning `eval_loss`, `eval_rewards/accuracies`, ...;
- logging: TRL's metric names, reduced over ranks (`metrics.py`).

Gradient normalisation. A micro-batch's loss is ``sum(pair losses) * W / N`` where N is the number of
pairs in the optimizer step over all W ranks (known from the plan, no communication). DDP averages
gradients over ranks (the W cancels), and `loss_is_scaled_for_ga = True` stops Trainer from dividing by
the accumulation steps again, so every step's gradient is that of the mean pair loss of the step, however
packing spread the pairs over micro-batches.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping

import torch
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

from prefixdpo.callbacks import NonFiniteLossError, PrefixDPOCallback, latest_checkpoint, load_state, tr_dpo_callback
from prefixdpo.attention.backends import build_attention_mask, resolve_backend
from prefixdpo.config import PrefixDPOConfig
from prefixdpo.config import data_options as default_data_options
from prefixdpo.data.loader import LoaderSettings, MicroBatches, make_dataloader
from prefixdpo.engines import (
    enable_requested_fsdp, prepare_reference_for_engine, refuse_unsupported_engine_options, whole_model_state_dict,
)
from prefixdpo.errors import UserError
from prefixdpo.training_data import as_examples, loader_settings, pad_token_id
from prefixdpo.forward import resolve_router_aux_loss_coef, restore_stock_attention, unwrap, zero_weight_loss
from prefixdpo.metrics import MetricSums
from prefixdpo.offloading import activation_offloading_context
from prefixdpo.model_setup import prepare_policy, prepare_reference
from prefixdpo.reference import PrecomputedReference, SeparateModelReference, choose_reference
from prefixdpo.step import Objective, pair_logps, pair_losses
from prefixdpo.step_context import StepContextBuilder

__all__ = ["PrefixDPOTrainer", "NonFiniteLossError"]  # the error is raised by our callback, caught by users

class PrefixDPOTrainer(Trainer):
    """DPO-family preference training with prefix sharing; TRL `DPOTrainer`-shaped constructor.

    model:        a causal LM or its name/path (safetensors; no remote code unless `args.trust_remote_code`).
    ref_model:    a separate frozen reference (model or name); None = the PEFT policy with its adapter off,
                  or a frozen copy of `model`; nothing at all for reference-free losses.
    train_dataset / eval_dataset: a list of `Example`s (used as is), or records / a `datasets.Dataset` / a
                  path, run through `prepare_examples` with `processing_class`; eval may be a dict.
    peft_config:  a `peft` config (e.g. `LoraConfig`) to wrap `model` with.
    """

    # compute_loss already divides by the step's pair count (see module docstring)
    loss_is_scaled_for_ga = True

    def __init__(self, model=None, ref_model=None, args: PrefixDPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, peft_config=None, data_options=None, callbacks=None,
                 optimizers=(None, None)):
        args = args if args is not None else PrefixDPOConfig()
        if not isinstance(args, PrefixDPOConfig):
            raise TypeError("args must be a PrefixDPOConfig")
        self.backend = resolve_backend(args.attention, args.device, needs_grad=True)  # once, for every pass
        logging.getLogger(__name__).info("attention backend: %s (attention=%s)", self.backend, args.attention)
        model, processing_class = prepare_policy(model, args, backend=self.backend, peft_config=peft_config,
                                                 tokenizer=processing_class)

        self._data_options = data_options or default_data_options(args)
        self.data_reports: dict = {}
        train_examples = self._as_examples(train_dataset, processing_class, "train")
        if isinstance(eval_dataset, Mapping):
            eval_examples = {k: self._as_examples(v, processing_class, f"eval_{k}") for k, v in eval_dataset.items()}
        else:
            eval_examples = self._as_examples(eval_dataset, processing_class, "eval")

        super().__init__(model=model, args=args, data_collator=None, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self.add_callback(PrefixDPOCallback(self))

        self._offload = activation_offloading_context(self.model, args.activation_offloading)
        ref_model = prepare_reference(ref_model, args, backend=self.backend, policy_dtype=self.model.dtype)
        self.reference = choose_reference(
            needs_reference=args.needs_reference, precompute=args.precompute_ref_log_probs, ref_model=ref_model,
            policy=self.model, chunk_size=args.logprob_chunk_size, backend=self.backend,
            cache_dir=args.resolved_ref_cache_dir(),
            batch_size=args.precompute_ref_batch_size or args.per_device_eval_batch_size,
            pad_token_id=self.pad_token_id, device=self.accelerator.device,
        )
        if isinstance(self.reference, SeparateModelReference):  # sharded / offloaded as the policy's engine needs
            self.reference.model = prepare_reference_for_engine(self.reference.model, self.accelerator)
        sync = tr_dpo_callback(args, self.reference, self.model)  # TR-DPO; refuses PEFT/precomputed as TRL 1.16
        if sync is not None:
            self.add_callback(sync)
        self.objective = Objective(tuple(args.loss_types), tuple(args.loss_weight_list), args.loss_params(),
                                   resolve_router_aux_loss_coef(self.model, args.router_aux_loss_coef))
        self.step_context = StepContextBuilder(self.objective, self.accelerator)
        self._metrics = {"train": MetricSums(), "eval": MetricSums()}
        self._pairs_trained = 0.0
        self._nonfinite_loss = None  # a non-finite micro-batch loss of this step (checked by the callback)
        self._train_micro: MicroBatches | None = None
        self.engine_description = "not started"  # set when training begins (`describe_engine`)
        if isinstance(self.reference, PrecomputedReference):  # every table before training, as TRL does
            evals = self.eval_dataset if isinstance(self.eval_dataset, Mapping) else {None: self.eval_dataset}
            named = [("train", self.train_dataset), *((f"eval_{k}" if k else "eval", v) for k, v in evals.items())]
            for name, examples in named:
                if examples is not None:
                    self.reference.table_for(examples, self.model, name)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        enable_requested_fsdp(self)  # accelerate drops a requested FSDP on CPU: apply it, or refuse
        refuse_unsupported_engine_options(self)

    def _as_examples(self, data, tokenizer, name: str):
        return as_examples(data, tokenizer, self._data_options, name, self.data_reports)

    @property
    def ref_model(self):
        """The separate reference model run every step, as TRL's attribute (None for other strategies)."""
        return getattr(self.reference, "model", None)

    # ---- data -------------------------------------------------------------------------------

    @property
    def pad_token_id(self) -> int:
        return pad_token_id(self.processing_class)

    def _loader_settings(self, *, train: bool) -> LoaderSettings:
        size = self._train_batch_size if train else self.args.per_device_eval_batch_size
        return loader_settings(self.args, train=train, batch_size=size, pad_token=self.pad_token_id,
                               backend=self.backend)

    def _micro_batches(self, examples, *, train: bool, name: str = "train") -> MicroBatches:
        precomputed = isinstance(self.reference, PrecomputedReference)
        return MicroBatches(examples, self._loader_settings(train=train), rank=self.args.process_index,
                            world_size=self.args.world_size,
                            ref_table=self.reference.table_for(examples, self.model, name) if precomputed else None)

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise UserError("PrefixDPOTrainer: training needs a train_dataset")
        self._train_micro = self._micro_batches(self.train_dataset, train=True)
        pin = self.args.dataloader_pin_memory and torch.cuda.is_available()  # pinning needs an accelerator
        return make_dataloader(self._train_micro, self.args.dataloader_num_workers, pin)

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is None and self.eval_dataset is None:
            raise UserError("PrefixDPOTrainer: evaluation needs an eval_dataset")
        name = "eval"
        if isinstance(eval_dataset, str):
            name, examples = f"eval_{eval_dataset}", self.eval_dataset[eval_dataset]
        elif eval_dataset is not None:
            examples = self._as_examples(eval_dataset, self.processing_class, "eval")
        else:
            examples = self.eval_dataset
        return make_dataloader(self._micro_batches(examples, train=False, name=name))

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # All micro-batches of one optimizer step are in hand here: losses coupled across the step's pairs
        # (sft, aot, bco_pair) get their step-wide context before the first forward.
        samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.step_context.attach(samples, self._prepass)
        return samples, None

    def _prepass(self, item):
        """No-grad per-pair log-probs of one micro-batch, for the step context. The reference's sums are kept
        in the item, so the training pass does not run the reference again (LD-DPO needs its tokens: rerun)."""
        batch = item["batch"].to(self.args.device)
        with torch.no_grad():
            if "ref_logps" not in item and self.objective.params.ld_alpha is None:
                ref = self.reference.logps(self.model, batch, build_attention_mask(batch.doc_ids, batch.branch_ids,
                                                                                   self.backend), item)
                if ref is not None:
                    item["ref_logps"] = ref
            return pair_logps(self.model, batch, reference=self.reference, backend=self.backend,
                              chunk_size=self.args.logprob_chunk_size, item=item, params=self.objective.params)

    # ---- loss -------------------------------------------------------------------------------

    def _pair_step(self, model, inputs: dict, split: str):
        """The micro-batch's PairStep (None for a zero-weight batch); adds its metric sums to `split`."""
        batch = inputs["batch"].to(self.args.device)
        if batch.num_pairs == 0:
            return None, batch
        context = inputs.get("step_context") if split == "train" else (
            self.step_context.for_evaluation if self.step_context.enabled else None)
        result = pair_losses(model, batch, reference=self.reference, objective=self.objective, backend=self.backend,
                             chunk_size=self.args.logprob_chunk_size, item=inputs, context=context)
        stats = result.metric_sums(self.args.beta)
        loss_sum = result.losses.detach().sum().item()
        if result.aux_loss is not None:  # TRL's logged loss includes the weighted aux loss
            loss_sum += self.objective.router_aux_loss_coef * float(result.aux_loss.detach()) * batch.num_pairs
        stats.update(pairs=batch.num_pairs, loss_sum=loss_sum,
                     **{k: inputs[k] for k in ("real_tokens", "slots", "shared_tokens", "unshared_tokens")})
        self._metrics[split].add(stats)
        return result, batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self._offload:  # activation_offloading (TRL's context; a no-op when off)
            return self._compute_loss(model, inputs, return_outputs)

    def _compute_loss(self, model, inputs, return_outputs):
        result, batch = self._pair_step(model, inputs, "train")
        if result is None:  # a rank-balancing empty slot
            loss = zero_weight_loss(model, batch, self.backend)
        else:
            # x num_processes: DDP/FSDP/DeepSpeed average gradients over ranks, while we want the sum over
            # ranks of (pair losses / all pairs of the step)
            loss = result.losses.sum() * (self.accelerator.num_processes / max(int(inputs["step_pairs"]), 1))
            if result.aux_loss is not None:
                # as TRL: coef x aux per micro-batch, averaged over accumulation steps and (by DDP) over ranks
                coef = self.objective.router_aux_loss_coef
                loss = loss + coef * result.aux_loss / self.current_gradient_accumulation_steps
        return (loss, {}) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not torch.isfinite(loss):  # PrefixDPOCallback stops before the optimizer applies this step
            self._nonfinite_loss = float(loss)
        return loss

    # ---- evaluation and logging -------------------------------------------------------------

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        # Trainer's loop concatenates logits and labels per batch; ours weighs every pair equally instead.
        # `_wrap_model` (private) is how Trainer's own loop gets the DDP/FSDP-wrapped model for inference.
        model = self._wrap_model(self.model, training=False, dataloader=dataloader)
        was_training = model.training
        model.eval()
        sums = self._metrics["eval"] = MetricSums()
        with torch.no_grad():
            for inputs in dataloader:
                self._pair_step(model, inputs, "eval")
        model.train(was_training)
        pairs = int(sums.reduced(self.accelerator)["pairs"])
        metrics = sums.summary(self.accelerator, prefix=f"{metric_key_prefix}_", with_loss=True)
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=pairs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every rank reaches this point together, so the reduce inside `summary` is safe.
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            logs = {**logs, **self._metrics["train"].summary(self.accelerator)}
            self._pairs_trained += self._metrics["train"].last_pairs
        if "train_runtime" in logs:  # Trainer counts micro-batches as samples; a sample here is a pair
            self._metrics["train"].summary(self.accelerator)
            self._pairs_trained += self._metrics["train"].last_pairs
            logs["train_samples_per_second"] = round(self._pairs_trained / max(logs["train_runtime"], 1e-9), 3)
        super().log(logs, start_time)

    def floating_point_ops(self, inputs) -> int:
        # 6 x parameters x real tokens (policy forward + backward), the usual estimate
        params = sum(p.numel() for p in unwrap(self.model).parameters())
        return 6 * params * int(inputs.get("real_tokens", 0)) if isinstance(inputs, Mapping) else 0

    # ---- train / save -----------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """Trainer.train; `resume_from_checkpoint="latest"` means the newest checkpoint in output_dir."""
        if resume_from_checkpoint == "latest":
            resume_from_checkpoint = latest_checkpoint(self.args.output_dir)
        if isinstance(resume_from_checkpoint, str):
            self.step_context.load_state_dict(load_state(resume_from_checkpoint))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # checkpoints (internal calls) stay as configured; an export is always a whole, stock-loadable model
        with contextlib.nullcontext() if _internal_call else whole_model_state_dict(self):
            super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            restore_stock_attention(output_dir if output_dir is not None else self.args.output_dir)
