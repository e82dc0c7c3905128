"""The optimizer step's coupling: what losses coupled across pairs need of the whole step (their rows in
`prefixdpo.dpo.loss_table` say what: the step's chosen tokens, its pairs' detached log-probs, a running mean).

Trainer hands us all micro-batches of one optimizer step before the first forward
(`PrefixDPOTrainer.get_batch_samples`). We collect what the coupled losses need over the step's pairs on
every rank, build the step's context once (`prefixdpo.dpo.objective.build_step_context`), and give each
micro-batch its slice (beside it, in the trainer's `StepInputs`), so packing, gradient accumulation and world size
cannot change the loss:

- sft / orpo / RPO need the step's chosen-token total: from the data, no forward;
- aot, aot_unpaired and training bco_pair need every pair's detached log-probs: one no-grad pre-pass over
  this rank's micro-batches, gathered over ranks. Its reference sums (and each micro-batch's mask) are kept for
  the training pass, so the extra cost is one no-grad policy forward per micro-batch.

Pairs are numbered rank by rank, then micro-batch by micro-batch, then in batch order.
"""

from __future__ import annotations

import torch

from prefixdpo.data.loader import MicroBatch
from prefixdpo.dpo.loss_table import PairLogps, StepPairs, canonical_loss_types, coupled, loss_row, needs_step_pairs
from prefixdpo.dpo.objective import RunningMean, build_step_context


class StepCoupling:
    """Builds each micro-batch's slice of the step's context; owns the losses' running means (saved in
    checkpoints)."""

    def __init__(self, objective, accelerator):
        self.objective = objective
        self.accelerator = accelerator
        self.names = canonical_loss_types(objective.loss_types)
        self.enabled = coupled(self.names)
        self.needs_pairs = needs_step_pairs(self.names, train=True)
        self.running = {name: RunningMean() for name in self.names if loss_row(name).running_mean}

    def contexts(self, samples: list[MicroBatch], prepassed: list[PairLogps | None]) -> list:
        """Each micro-batch's slice of the step context (`samples`: the step's micro-batches on this rank).

        prepassed: per micro-batch, its detached PairLogps from the pre-pass (where `needs_pairs` and it has pairs).
        """
        if not self.enabled or not samples:
            return [None] * len(samples)
        rows, counts = [], []  # per pair: chosen tokens[, policy c, policy r, ref c, ref r]
        for item, p in zip(samples, prepassed):
            batch = item.batch
            cols = [batch.response_lengths[batch.pair_better].double()]
            if self.needs_pairs and batch.num_pairs:
                cols += [t.detach().double().cpu() for t in (p.policy_chosen_logps, p.policy_rejected_logps,
                                                              p.ref_chosen_logps, p.ref_rejected_logps)]
            width = 5 if self.needs_pairs else 1
            rows.append(torch.stack(cols, dim=1) if batch.num_pairs else torch.zeros(0, width, dtype=torch.float64))
            counts.append(batch.num_pairs)
        everyone = self._gather(torch.cat(rows))  # one [P_rank, width] tensor per rank, in rank order
        offset = sum(int(t.shape[0]) for t in everyone[: self.accelerator.process_index])
        step = torch.cat(everyone)
        planned = samples[0].step_pairs
        if step.shape[0] != planned:
            raise RuntimeError(f"step context: gathered {step.shape[0]} pairs, the plan says {planned}")
        pairs = StepPairs(*step[:, 1:5].unbind(1)) if self.needs_pairs else None
        context = build_step_context(self.names, self.objective.params, pairs, num_pairs=planned,
                                     chosen_tokens=float(step[:, 0].sum()), running=self.running, train=True)
        slices = []
        for n in counts:
            slices.append(context.local(torch.arange(offset, offset + n)))
            offset += n
        return slices

    def for_evaluation(self, inputs):
        """Context of one evaluation micro-batch (its own pairs; running means are read, never moved)."""
        pairs = StepPairs.of(inputs) if needs_step_pairs(self.names, train=False) else None
        return build_step_context(self.names, self.objective.params, pairs,
                                  num_pairs=inputs.policy_chosen_logps.numel(),
                                  chosen_tokens=inputs.chosen_lengths.sum(), running=self.running, train=False)

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.accelerator.num_processes == 1:
            return [t]
        from accelerate.utils import gather_object

        width = t.shape[1]
        return [torch.tensor(part, dtype=torch.float64).reshape(-1, width) for part in gather_object([t.tolist()])]

    def state_dict(self) -> dict:
        return {"running_means": {name: mean.state_dict() for name, mean in self.running.items()}}

    def load_state_dict(self, state: dict) -> None:
        saved = dict(state.get("running_means", {}))
        if "bco_running_mean" in state:  # a checkpoint written before the loss table
            saved.setdefault("bco_pair", state["bco_running_mean"])
        for name, mean in self.running.items():
            if name in saved:
                mean.load_state_dict(saved[name])
