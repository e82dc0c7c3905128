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
from dataclasses import dataclass, replace
from typing import Any

import torch

from prefixdpo.core.attention.backends import batch_attention_mask
from prefixdpo.training.nonfinite import NonFiniteLossError
from prefixdpo.dpo.config import PrefixDPOConfig
from prefixdpo.dpo.config import data_options as default_data_options
from prefixdpo.core.fit import check_run_fits
from prefixdpo.core.moe import resolve_router_aux_loss_coef
from prefixdpo.dpo.metrics import DPOMetricSums
from prefixdpo.training.model_setup import prepare_policy
from prefixdpo.dpo.reference import IdleReference, build_reference
from prefixdpo.data.batch import Batch
from prefixdpo.data.loader import MicroBatch, stand_in_batch
from prefixdpo.dpo.objective import PairLogps
from prefixdpo.dpo.step import Objective, pair_logps, pair_losses, zero_weight_loss
from prefixdpo.dpo.coupling import StepCoupling
from prefixdpo.training.base import PrefixTrainerBase
from prefixdpo.training.options import resolve_tokens_per_pass
from prefixdpo.data.inputs import as_examples

__all__ = ["PrefixDPOTrainer", "NonFiniteLossError"]  # the error is raised by our callback, caught by users


@dataclass(frozen=True)
class StepInputs:
    """One micro-batch as an optimizer step hands it to `compute_loss`: the loader's MicroBatch, unchanged, and
    what the step worked out for it beside it.

    micro:     the loader's `MicroBatch`
    context:   its slice of the step context (losses coupled across the step's pairs), or None; in evaluation,
               a function of the batch's PairLogps (`StepCoupling.for_evaluation`)
    batch:     `micro.batch` on the device, and mask: its attention mask for the run's backend: built once (by
               the pre-pass, or by `on_device` before the training pass) for every pass over the micro-batch.
               A rank-balancing empty micro-batch (`idle`: no pair) gets a stand-in line instead
               (`loader.stand_in_batch`), whose passes it runs at zero weight
    ref_logps: [R] the reference's log-prob sums the pre-pass read (run, or a precomputed table's rows), or None
               (no pre-pass: the training pass asks the reference)
    """

    micro: MicroBatch
    context: Any = None
    batch: Batch | None = None
    mask: Any = None
    ref_logps: torch.Tensor | None = None

    @property
    def idle(self) -> bool:
        """A rank-balancing empty micro-batch: it runs a real one's passes at zero weight."""
        return self.micro.batch.num_pairs == 0

    def on_device(self, device, backend: str, pad_token_id: int, tokens_per_pass: int | None = None) -> "StepInputs":
        """This micro-batch with its Batch (an idle one's stand-in line) on `device` and its attention mask (kept if
        already built; a `PrefixReuse` plan for a line over `tokens_per_pass`)."""
        if self.batch is not None:
            return self
        batch = (stand_in_batch(pad_token_id) if self.idle else self.micro.batch).to(device)
        return replace(self, batch=batch, mask=batch_attention_mask(batch, backend, max_tokens_per_pass=tokens_per_pass))


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
        self.tokens_per_pass = resolve_tokens_per_pass(args, model)  # prefix reuse's budget, or None

        self._data_options = data_options or default_data_options(args)
        self.data_reports: dict = {}
        train_examples, eval_examples = self._examples_of(train_dataset, eval_dataset, processing_class, args)
        check_run_fits(model, args, self.backend, train_examples, eval_examples)  # before any work (fit.py)

        super().__init__(model=model, args=args, data_collator=None, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self._init_run_state()
        self.reference = build_reference(args, policy=self.model, ref_model=ref_model, backend=self.backend,
                                         pad_token_id=self.pad_token_id, accelerator=self.accelerator)
        self.reference.use_tokens_per_pass(self.tokens_per_pass)  # its table passes run long examples the same way
        for callback in self.reference.callbacks:  # TR-DPO's sync, when asked for
            self.add_callback(callback)
        self.objective = Objective(tuple(args.loss_types), tuple(args.loss_weight_list), args.loss_params(),
                                   resolve_router_aux_loss_coef(self.model, args.router_aux_loss_coef))
        self.coupling = StepCoupling(self.objective, self.accelerator)
        self._idle_reference = IdleReference(self.reference)  # what an idle micro-batch asks (`StepInputs.idle`)
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

    def _micro_batch(self, inputs: StepInputs) -> MicroBatch:
        return inputs.micro

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # All micro-batches of one optimizer step are in hand here: losses coupled across the step's pairs
        # (sft, aot, bco_pair) get their step-wide context before the first forward.
        micro_batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        return self._in_step(micro_batches), None

    def _in_step(self, micro_batches: list[MicroBatch]) -> list[StepInputs]:
        """Each micro-batch of an optimizer step with what the step works out for it: its slice of the step
        context and, where the coupled losses need every pair's log-probs first, the pre-pass's results."""
        steps = [StepInputs(micro) for micro in micro_batches]
        if not self.coupling.enabled:
            return steps
        pairs = [None] * len(steps)
        if self.coupling.needs_pairs:  # an idle micro-batch too: its passes join the other ranks' collectives
            for i, micro in enumerate(micro_batches):
                steps[i], pairs[i] = self._prepass(micro)
        contexts = self.coupling.contexts(micro_batches, pairs)
        return [replace(step, context=context) for step, context in zip(steps, contexts)]

    def _prepass(self, micro: MicroBatch) -> tuple[StepInputs, PairLogps]:
        """No-grad per-pair log-probs of one micro-batch, for the step context. Its batch on the device, its mask
        and the reference's sums are kept beside the micro-batch, so the training pass builds no second mask and
        runs no second reference pass (LD-DPO needs the reference's tokens: it reruns the reference)."""
        step = self._on_device(StepInputs(micro))
        reference = self._reference_of(step)
        with torch.no_grad():
            if self.objective.params.ld_alpha is None:
                step = replace(step, ref_logps=reference.sums(self.model, step.batch, step.mask, micro))
            pairs = pair_logps(self.model, step.batch, step.mask, reference=reference,
                               chunk_size=self.args.logprob_chunk_size, item=micro, ref_logps=step.ref_logps,
                               params=self.objective.params)
        return step, pairs

    def _on_device(self, step: StepInputs) -> StepInputs:
        return step.on_device(self.args.device, self.backend, self.pad_token_id, self.tokens_per_pass)

    def _reference_of(self, step: StepInputs):
        """The reference `step`'s passes ask: the run's, or, for an idle micro-batch, the run's at zero weight."""
        return self._idle_reference if step.idle else self.reference

    # ---- loss -------------------------------------------------------------------------------

    def _pair_step(self, model, inputs: StepInputs | MicroBatch, split: str):
        """(the micro-batch's PairStep, None), or, for a rank-balancing empty micro-batch, (None, its zero-weight
        loss), for which it ran a real micro-batch's passes (`step.zero_weight_loss`); adds its metric sums to
        `split`. Training passes StepInputs (`get_batch_samples`), evaluation the loader's MicroBatch (an empty
        one runs the passes too, under evaluation's no_grad: every rank joins the same collectives)."""
        if split == "train":
            step = inputs
        else:
            step = StepInputs(inputs, context=self.coupling.for_evaluation if self.coupling.enabled else None)
        step = self._on_device(step)
        batch = step.batch
        if step.idle:
            return None, zero_weight_loss(model, batch, step.mask, reference=self._idle_reference,
                                          objective=self.objective, chunk_size=self.args.logprob_chunk_size,
                                          ref_logps=step.ref_logps)
        result = pair_losses(model, batch, step.mask, reference=self.reference, objective=self.objective,
                             chunk_size=self.args.logprob_chunk_size, item=step.micro, ref_logps=step.ref_logps,
                             context=step.context)
        stats = result.metric_sums(self.args.beta)
        loss_sum = result.losses.detach().sum().item()
        if result.aux_loss is not None:  # TRL's logged loss includes the weighted aux loss
            loss_sum += self.objective.router_aux_loss_coef * float(result.aux_loss.detach()) * batch.num_pairs
        stats.update(pairs=batch.num_pairs, loss_sum=loss_sum, **step.micro.token_counts())
        self._metrics[split].add(stats)
        return result, None

    def _compute_loss(self, model, inputs, return_outputs):
        result, idle_loss = self._pair_step(model, inputs, "train")
        if result is None:  # a rank-balancing empty slot
            loss = idle_loss
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
