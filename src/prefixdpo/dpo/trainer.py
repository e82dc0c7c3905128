"""`PrefixDPOTrainer`: DPO-family training on prefix-shared rows, built on `transformers.Trainer`.

Trainer keeps everything that is not preference-specific (optimizer, schedules, checkpoints and resume,
mixed precision, logging integrations, DDP/FSDP/DeepSpeed); `trainer_base.PrefixTrainerBase` adds what every
prefixdpo trainer shares (micro-batch data, the step's pair normalisation, pair-weighted evaluation,
logging, engines, export). Here:

- `compute_loss`: `step.pair_losses` (policy, reference strategy, losses) for the micro-batch, normalised
  by the pairs of the whole optimizer step; losses coupled across the step's pairs get the step's context;
- the reference: one strategy (`reference.py`, built by `build_reference`), asked only through its methods;
- logging: TRL's metric names, reduced over ranks (`metrics.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from prefixdpo.core.attention.backends import build_attention_mask
from prefixdpo.training.nonfinite import NonFiniteLossError
from prefixdpo.dpo.config import PrefixDPOConfig
from prefixdpo.dpo.config import data_options as default_data_options
from prefixdpo.core.fit import check_run_fits
from prefixdpo.core.moe import resolve_router_aux_loss_coef
from prefixdpo.core.forward import zero_weight_loss
from prefixdpo.dpo.metrics import DPOMetricSums
from prefixdpo.training.model_setup import prepare_policy
from prefixdpo.dpo.reference import build_reference
from prefixdpo.dpo.step import Objective, pair_logps, pair_losses
from prefixdpo.dpo.coupling import StepCoupling
from prefixdpo.training.base import PrefixTrainerBase
from prefixdpo.data.inputs import as_examples

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
        args = self._checked_args(args, PrefixDPOConfig)
        model, processing_class = prepare_policy(model, args, backend=self.backend, peft_config=peft_config,
                                                 tokenizer=processing_class)

        self._data_options = data_options or default_data_options(args)
        self.data_reports: dict = {}
        train_examples, eval_examples = self._examples_of(train_dataset, eval_dataset, processing_class)
        check_run_fits(model, args, self.backend, train_examples, eval_examples)  # before any work (fit.py)

        super().__init__(model=model, args=args, data_collator=None, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self._init_run_state()
        self.reference = build_reference(args, policy=self.model, ref_model=ref_model, backend=self.backend,
                                         pad_token_id=self.pad_token_id, accelerator=self.accelerator)
        for callback in self.reference.callbacks:  # TR-DPO's sync, when asked for
            self.add_callback(callback)
        self.objective = Objective(tuple(args.loss_types), tuple(args.loss_weight_list), args.loss_params(),
                                   resolve_router_aux_loss_coef(self.model, args.router_aux_loss_coef))
        self.coupling = StepCoupling(self.objective, self.accelerator)
        self.reference.precompute_tables(self._named_datasets(), self.model)  # before training, as TRL does

    def _as_examples(self, data, tokenizer, name: str):
        return as_examples(data, tokenizer, self._data_options, name, self.data_reports)

    def _named_datasets(self) -> list:
        """[(name, examples or None)]: train, then each eval set ("eval", or "eval_<key>" of a dict)."""
        evals = self.eval_dataset if isinstance(self.eval_dataset, Mapping) else {None: self.eval_dataset}
        return [("train", self.train_dataset), *((f"eval_{k}" if k else "eval", v) for k, v in evals.items())]

    def _new_metric_sums(self) -> DPOMetricSums:
        return DPOMetricSums()

    @property
    def ref_model(self):
        """The separate reference model run every step, as TRL's attribute (None for other strategies)."""
        return self.reference.model

    # ---- data -------------------------------------------------------------------------------

    def _reference_table(self, examples, name: str):
        return self.reference.table_for(examples, self.model, name)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # All micro-batches of one optimizer step are in hand here: losses coupled across the step's pairs
        # (sft, aot, bco_pair) get their step-wide context before the first forward.
        samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.coupling.attach(samples, self._prepass)
        return samples, None

    def _prepass(self, item):
        """No-grad per-pair log-probs of one micro-batch, for the step context. The reference's sums are kept
        in the item, so the training pass does not run the reference again (LD-DPO needs its tokens: rerun)."""
        batch = item["batch"].to(self.args.device)
        with torch.no_grad():
            if self.objective.params.ld_alpha is None:
                ref = self.reference.sums(self.model, batch, build_attention_mask(batch.doc_ids, batch.branch_ids,
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
            self.coupling.for_evaluation if self.coupling.enabled else None)
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

    def _compute_loss(self, model, inputs, return_outputs):
        result, batch = self._pair_step(model, inputs, "train")
        if result is None:  # a rank-balancing empty slot
            loss = zero_weight_loss(model, batch, self.backend)
        else:
            # x num_processes: DDP/FSDP/DeepSpeed average gradients over ranks, while we want the sum over
            # ranks of (pair losses / all pairs of the step)
            loss = result.losses.sum() * self._step_share(inputs)
            if result.aux_loss is not None:
                # as TRL: coef x aux per micro-batch, averaged over accumulation steps and (by DDP) over ranks
                coef = self.objective.router_aux_loss_coef
                loss = loss + coef * result.aux_loss / self.current_gradient_accumulation_steps
        return (loss, {}) if return_outputs else loss

    # ---- resume -----------------------------------------------------------------------------

    def _checkpoint_state(self) -> dict:
        return self.coupling.state_dict()  # e.g. BCO's running mean

    def _restore_checkpoint_state(self, state: dict) -> None:
        self.coupling.load_state_dict(state)
