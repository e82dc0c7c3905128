"""`PrefixDPOTrainer`: DPO-family training on prefix-shared rows, built on `transformers.Trainer`.

Trainer keeps everything that is not preference-specific (optimizer, schedules, checkpoints and
resume, mixed precision, logging integrations, DDP/FSDP/DeepSpeed). We replace four things:

- the data loaders: each item is one micro-batch `Batch` (padded or packed lines), planned per epoch
  with the seed, the same number of micro-batches on every rank (`data/loader.py`);
- `compute_loss`: policy log-probs with grad, reference log-probs without (`reference.py`), the
  per-pair losses (`losses.py`), normalised by the pairs of the whole optimizer step;
- evaluation: a pair-weighted loop returning `eval_loss`, `eval_rewards/accuracies`, ...;
- logging: TRL's metric names, reduced over ranks (`metrics.py`).

Gradient normalisation. A micro-batch's loss is ``sum(pair losses) * W / N`` where N is the number
of pairs in the optimizer step over all W ranks (known from the plan, no communication). DDP averages
gradients over ranks (the W cancels), and `loss_is_scaled_for_ga = True` stops Trainer from dividing
by the accumulation steps again, so every step's gradient is that of the mean pair loss of the step,
however packing spread the pairs over micro-batches.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer
from transformers.trainer_utils import EvalLoopOutput, get_last_checkpoint

from prefixdpo.attention.backends import build_attention_mask, resolve_backend
from prefixdpo.config import PrefixDPOConfig, data_options
from prefixdpo.data.example import Example
from prefixdpo.data.loader import LoaderSettings, MicroBatches, make_dataloader
from prefixdpo.forward import compute_response_logps, final_hidden_states, prepare_model, unwrap
from prefixdpo.logprobs import lm_head_fn
from prefixdpo.losses import BCORunningMean, LossConfigError, PairLogps, combined_loss
from prefixdpo.metrics import MetricSums, pair_metric_sums
from prefixdpo.reference import is_peft_model, load_or_compute_table, reference_sums

logger = logging.getLogger(__name__)


class NonFiniteLossError(ValueError):
    """The loss became NaN/inf; training stopped before the optimizer step that would apply it."""


def _load_causal_lm(name: str, args: PrefixDPOConfig):
    dtype = torch.bfloat16 if args.bf16 else "auto"
    return AutoModelForCausalLM.from_pretrained(name, trust_remote_code=args.trust_remote_code, dtype=dtype)


def _disable_dropout(model) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _is_examples(data) -> bool:
    return isinstance(data, (list, tuple)) and len(data) > 0 and all(isinstance(x, Example) for x in data)


class PrefixDPOTrainer(Trainer):
    """DPO-family preference training with prefix sharing; TRL `DPOTrainer`-shaped constructor.

    model:        a causal LM or its name/path (loaded with safetensors; no remote code unless
                  `args.trust_remote_code`).
    ref_model:    a separate frozen reference (model or name); None = the PEFT policy with its adapter
                  off, or a frozen copy of `model`; not loaded at all for reference-free losses.
    train_dataset / eval_dataset: a list of `Example`s (used as is), or records / a `datasets.Dataset`
                  / a path, run through `prepare_examples` with `processing_class`; eval may be a dict.
    peft_config:  a `peft` config (e.g. `LoraConfig`) to wrap `model` with.
    """

    # compute_loss already divides by the step's pair count (see module docstring)
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model=None,
        ref_model=None,
        args: PrefixDPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        peft_config=None,
        data_options=None,
        callbacks=None,
        optimizers=(None, None),
    ):
        args = args if args is not None else PrefixDPOConfig()
        if not isinstance(args, PrefixDPOConfig):
            raise TypeError("args must be a PrefixDPOConfig")
        if isinstance(model, str):
            if processing_class is None:
                processing_class = AutoTokenizer.from_pretrained(model, trust_remote_code=args.trust_remote_code)
            model = _load_causal_lm(model, args)
        if model is None:
            raise ValueError("PrefixDPOTrainer needs a model (a model object or a name/path)")
        if peft_config is not None:
            if is_peft_model(model):
                raise ValueError("model is already a PEFT model; do not pass peft_config as well")
            from peft import get_peft_model

            if args.activation_checkpointing and hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
            model = get_peft_model(model, peft_config)
        if args.disable_dropout:
            _disable_dropout(model)

        self._backend_name = args.attention
        device_backend = resolve_backend(args.attention, args.device, needs_grad=True)
        prepare_model(model, device_backend)

        # ---- reference mode ----
        self.ref_model = None
        if not args.needs_reference:
            self.reference_mode = "none"
        elif args.precompute_ref_log_probs:
            self.reference_mode = "precomputed"
        elif ref_model is not None:
            self.reference_mode = "model"
        elif is_peft_model(model):
            self.reference_mode = "adapter"
        else:
            self.reference_mode = "model"
            ref_model = copy.deepcopy(model)  # TRL's create_reference_model: a frozen copy of the start
        if self.reference_mode in ("model", "precomputed") and isinstance(ref_model, str):
            ref_model = _load_causal_lm(ref_model, args)
        if ref_model is not None and self.reference_mode != "none":
            prepare_model(ref_model, resolve_backend(args.attention, args.device, needs_grad=False))
            ref_model.eval()
            ref_model.requires_grad_(False)
            if args.disable_dropout:
                _disable_dropout(ref_model)
            self.ref_model = ref_model

        # ---- data ----
        self._data_options = data_options
        self.data_reports: dict[str, Any] = {}
        train_examples = self._as_examples(train_dataset, processing_class, args, "train")
        if isinstance(eval_dataset, Mapping):
            eval_examples = {k: self._as_examples(v, processing_class, args, f"eval_{k}") for k, v in eval_dataset.items()}
        else:
            eval_examples = self._as_examples(eval_dataset, processing_class, args, "eval")

        super().__init__(
            model=model,
            args=args,
            data_collator=lambda items: items[0],
            train_dataset=train_examples,
            eval_dataset=eval_examples,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        if self.ref_model is not None and self.reference_mode == "model":
            self.ref_model.to(self.accelerator.device)

        self.loss_params = args.loss_params()
        self.bco_state = BCORunningMean() if "bco_pair" in args.loss_types else None
        self._metrics = {"train": MetricSums(), "eval": MetricSums()}
        self._nonfinite = False
        self._train_micro: MicroBatches | None = None
        self.ref_tables: dict[int, Any] = {}
        self.ref_cache_hits: dict[str, bool] = {}
        if self.reference_mode == "precomputed":
            self._precompute_reference()
            if self.ref_model is not None:
                self.ref_model = None  # its log-probs are on disk now: free the memory

    # ------------------------------------------------------------------------------------------
    # data
    # ------------------------------------------------------------------------------------------

    def _as_examples(self, data, tokenizer, args, name: str):
        if data is None:
            return None
        if _is_examples(data):
            return list(data)
        if isinstance(data, (list, tuple)) and not data:
            raise ValueError(f"{name} dataset is empty")
        if tokenizer is None:
            raise ValueError(f"{name} dataset holds records, not Examples: pass processing_class (a tokenizer)")
        from prefixdpo.data.prepare import prepare_examples

        prepared = prepare_examples(data, tokenizer, self._data_options or data_options(args))
        self.data_reports[name] = prepared.report
        if not prepared.examples:
            raise ValueError(f"{name} dataset: no usable examples ({prepared.report.summary()})")
        return prepared.examples

    @property
    def pad_token_id(self) -> int:
        tok = self.processing_class
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(tok, attr, None) if tok is not None else None
            if isinstance(value, int):
                return value
        return 0  # any id works: padding is masked out and never a target

    def _loader_settings(self, *, train: bool) -> LoaderSettings:
        a = self.args
        return LoaderSettings(
            batch_size=self._train_batch_size if train else a.per_device_eval_batch_size,
            prefix_sharing=a.prefix_sharing,
            packing=a.packing,
            pack_length=None if str(a.pack_length) == "auto" else int(a.pack_length),
            pad_token_id=self.pad_token_id,
            pad_multiple=a.pad_to_multiple_of or 1,
            bucket=resolve_backend(a.attention, a.device, needs_grad=train) == "flex",
            shuffle=train,
            seed=a.data_seed if a.data_seed is not None else a.seed,
            grad_accum=a.gradient_accumulation_steps if train else 1,
        )

    def _micro_batches(self, examples: Sequence[Example], *, train: bool) -> MicroBatches:
        return MicroBatches(
            examples, self._loader_settings(train=train), rank=self.args.process_index,
            world_size=self.args.world_size, ref_table=self.ref_tables.get(id(examples)),
        )

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("PrefixDPOTrainer: training needs a train_dataset")
        self._train_micro = self._micro_batches(self.train_dataset, train=True)
        return make_dataloader(self._train_micro, self.args.dataloader_num_workers, self.args.dataloader_pin_memory)

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("PrefixDPOTrainer: evaluation needs an eval_dataset")
        if isinstance(eval_dataset, str):
            examples = self.eval_dataset[eval_dataset]
        elif eval_dataset is not None:
            examples = eval_dataset if _is_examples(eval_dataset) else self._as_examples(
                eval_dataset, self.processing_class, self.args, "eval")
        else:
            examples = self.eval_dataset
        if self.reference_mode == "precomputed" and id(examples) not in self.ref_tables:
            self._precompute_reference([("eval_extra", examples)])
        return make_dataloader(self._micro_batches(examples, train=False))

    def _run_epoch(self, *args, **kwargs):
        # Re-plan this epoch's micro-batches (seeded by epoch) before Trainer iterates (and maybe
        # skips into) them; Trainer's own set_epoch call does not reach us after a resume skip.
        epoch = kwargs["epoch"] if "epoch" in kwargs else args[1]
        if self._train_micro is not None:
            self._train_micro.set_epoch(epoch)
        return super()._run_epoch(*args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        samples = []
        for _ in range(num_batches):
            try:
                samples.append(next(epoch_iterator))
            except StopIteration:
                break
        # The step's pair count over all ranks, planned ahead (identical in every micro-batch of the step).
        return samples, (samples[0]["step_pairs"] if samples else None)

    # ------------------------------------------------------------------------------------------
    # reference
    # ------------------------------------------------------------------------------------------

    def _precompute_reference(self, datasets=None) -> None:
        if datasets is None:
            datasets = [("train", self.train_dataset)]
            if isinstance(self.eval_dataset, Mapping):
                datasets += [(f"eval_{k}", v) for k, v in self.eval_dataset.items()]
            elif self.eval_dataset is not None:
                datasets.append(("eval", self.eval_dataset))
        source = self.ref_model if self.ref_model is not None else self.model
        adapter = self.ref_model is None and is_peft_model(self.model)
        backend = resolve_backend(self.args.attention, self.args.device, needs_grad=False)
        settings = {"dtype": str(next(unwrap(source).parameters()).dtype), "adapter_off": adapter}
        for name, examples in datasets:
            if examples is None:
                continue
            table, path, hit = load_or_compute_table(
                source, examples, self.args.resolved_ref_cache_dir(), adapter=adapter, settings=settings,
                batch_size=self.args.precompute_ref_batch_size or self.args.per_device_eval_batch_size,
                backend=backend, chunk_size=self.args.logprob_chunk_size, pad_token_id=self.pad_token_id,
                device=self.args.device,
            )
            self.ref_tables[id(examples)] = table
            self.ref_cache_hits[name] = hit
            logger.info("reference log-probs for %s %s %s", name, "loaded from" if hit else "computed and saved to", path)

    def _reference(self, model, inputs: dict, batch, backend: str, mask) -> torch.Tensor | None:
        """Reference sums [R] for the batch, by the trainer's reference mode."""
        if self.reference_mode == "none":
            return None
        if self.reference_mode == "precomputed":
            return inputs["ref_logps"].to(batch.input_ids.device)
        if self.reference_mode == "adapter":
            return reference_sums(model, batch, adapter=True, backend=backend,
                                  chunk_size=self.args.logprob_chunk_size, attention_mask=mask)
        return reference_sums(self.ref_model, batch, backend=backend,
                              chunk_size=self.args.logprob_chunk_size, attention_mask=mask)

    # ------------------------------------------------------------------------------------------
    # loss
    # ------------------------------------------------------------------------------------------

    def _pair_losses(self, model, inputs: dict, split: str):
        """Per-pair losses [P] of one micro-batch (None for a zero-weight batch); records metric sums."""
        batch = inputs["batch"].to(self.args.device)
        if batch.num_pairs == 0:
            return None, batch
        backend = resolve_backend(self.args.attention, batch.input_ids.device, needs_grad=torch.is_grad_enabled())
        mask = build_attention_mask(batch.doc_ids, batch.branch_ids, backend)
        policy = compute_response_logps(model, batch, backend=backend, chunk_size=self.args.logprob_chunk_size,
                                        attention_mask=mask)
        ref = self._reference(model, inputs, batch, backend, mask)
        b, w = batch.pair_better, batch.pair_worse
        lengths = policy.counts.to(policy.sums.dtype)
        pair_inputs = PairLogps(
            policy_chosen_logps=policy.sums[b], policy_rejected_logps=policy.sums[w],
            ref_chosen_logps=None if ref is None else ref[b].to(policy.sums.dtype),
            ref_rejected_logps=None if ref is None else ref[w].to(policy.sums.dtype),
            chosen_lengths=lengths[b], rejected_lengths=lengths[w],
        )
        losses, _ = combined_loss(self.args.loss_types, self.args.loss_weight_list, pair_inputs,
                                  self.loss_params, self.bco_state)
        stats = pair_metric_sums(pair_inputs.policy_chosen_logps, pair_inputs.policy_rejected_logps,
                                 pair_inputs.ref_chosen_logps, pair_inputs.ref_rejected_logps,
                                 pair_inputs.chosen_lengths, pair_inputs.rejected_lengths, self.args.beta)
        stats.update(pairs=batch.num_pairs, loss_sum=losses.detach().sum().item(),
                     **{k: inputs[k] for k in ("real_tokens", "slots", "shared_tokens", "unshared_tokens")})
        self._metrics[split].add(stats)
        return losses, batch

    def _zero_weight_loss(self, model, batch) -> torch.Tensor:
        """0 x (a function of every parameter): runs the model so DDP's gradient sync still happens."""
        backend = resolve_backend(self.args.attention, batch.input_ids.device, needs_grad=True)
        mask = build_attention_mask(batch.doc_ids, batch.branch_ids, backend)
        hidden, _ = final_hidden_states(model, batch, mask)
        return lm_head_fn(unwrap(model))(hidden[:, -1]).sum() * 0.0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        losses, batch = self._pair_losses(model, inputs, "train")
        if losses is None:
            loss = self._zero_weight_loss(model, batch)
        else:
            step_pairs = num_items_in_batch if num_items_in_batch is not None else batch.num_pairs
            # x num_processes: DDP/FSDP/DeepSpeed average gradients over ranks, while we want the sum
            # over ranks of (pair losses / all pairs of the step).
            loss = losses.sum() * (self.accelerator.num_processes / max(int(step_pairs), 1))
        return (loss, {}) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._nonfinite = self._nonfinite or not bool(torch.isfinite(loss))
        if self.accelerator.sync_gradients:  # last micro-batch of the step: decide together, before the update
            flag = torch.tensor([float(self._nonfinite)], device=self.args.device)
            if self.accelerator.num_processes > 1:
                flag = self.accelerator.reduce(flag, reduction="sum")
            self._nonfinite = False
            if flag.item() > 0:
                last = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
                raise NonFiniteLossError(
                    f"loss became {float(loss)} (NaN/inf) in optimizer step {self.state.global_step + 1}; stopped "
                    f"before applying it. Last good checkpoint: {last or 'none saved yet'}. Try a lower learning "
                    "rate, fp32/bf16 instead of fp16, or check the data."
                )
        return loss

    # ------------------------------------------------------------------------------------------
    # evaluation and logging
    # ------------------------------------------------------------------------------------------

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        model = self._wrap_model(self.model, training=False, dataloader=dataloader)
        was_training = model.training
        model.eval()
        sums = MetricSums()
        self._metrics["eval"] = sums
        with torch.no_grad():
            for inputs in dataloader:
                self._pair_losses(model, inputs, "eval")
        if was_training:
            model.train()
        pairs = int(sums.reduced(self.accelerator)["pairs"])
        metrics = sums.summary(self.accelerator, prefix=f"{metric_key_prefix}_", with_loss=True)
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=pairs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Training logs (they carry "loss") get the metrics of the steps since the last log; every rank
        # reaches this point together, so the reduce inside is safe.
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            logs = {**logs, **self._metrics["train"].summary(self.accelerator)}
        super().log(logs, start_time)

    def floating_point_ops(self, inputs) -> int:
        # 6 x parameters x real tokens (policy forward + backward), the usual estimate
        params = sum(p.numel() for p in unwrap(self.model).parameters())
        return 6 * params * int(inputs.get("real_tokens", 0)) if isinstance(inputs, Mapping) else 0

    # ------------------------------------------------------------------------------------------
    # train / save
    # ------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """Trainer.train; `resume_from_checkpoint="latest"` means the newest checkpoint in output_dir."""
        if resume_from_checkpoint == "latest":
            last = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
            if last is None:
                raise ValueError(f"resume_from_checkpoint='latest': no checkpoint-* folder in {self.args.output_dir}")
            resume_from_checkpoint = last
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        path = os.path.join(output_dir, "config.json")
        if self.args.should_save and os.path.isfile(path):
            # Our attention name exists only where prefixdpo is imported: save the stock one so
            # `AutoModelForCausalLM.from_pretrained` loads the model anywhere.
            with open(path, encoding="utf-8") as fh:
                cfg = json.load(fh)
            changed = False
            for key in ("_attn_implementation", "attn_implementation", "_attn_implementation_internal"):
                if cfg.get(key) == "prefixdpo":
                    cfg[key] = "sdpa"
                    changed = True
            if changed:
                with open(path, "w", encoding="utf-8") as fh:
                    json.dump(cfg, fh, indent=2, sort_keys=True)
