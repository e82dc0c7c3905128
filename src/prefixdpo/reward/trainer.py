"""`PrefixRewardTrainer`: Bradley-Terry reward-model training on prefix-shared rows, on `transformers.Trainer`.

The data path is the DPO trainer's: records -> Examples (every format, pairs policy, validation) ->
per-epoch micro-batch plans (padded or packed lines, the same number of micro-batches on every rank,
re-planned each epoch by `RunCallback`) -> `Batch`. Per micro-batch, one pass of the reward model
scores every response of every example once (`scores.compute_response_scores`); each preference pair
the pairs policy names gives one loss term (`losses.pair_reward_losses`).

Gradient normalisation, evaluation, logging, engines and export are `trainer_base.PrefixTrainerBase`'s:
every step's gradient is that of the mean pair loss of the step, however packing, accumulation and ranks
split it. TRL averages micro-batch means instead; the two agree when micro-batches hold equal pair counts.
"""

from __future__ import annotations

from prefixdpo.core.stock_attention import plan_run_pass
from prefixdpo.data.loader import MicroBatch
from prefixdpo.reward.config import PrefixRewardConfig, reward_data_options
from prefixdpo.reward.data import reward_examples
from prefixdpo.reward.losses import RewardMetricSums, pair_metric_values, pair_reward_losses
from prefixdpo.reward.model import prepare_reward_model
from prefixdpo.core.scores import compute_response_scores
from prefixdpo.training.base import PrefixTrainerBase
from prefixdpo.training.options import resolve_tokens_per_pass

__all__ = ["PrefixRewardTrainer"]


class PrefixRewardTrainer(PrefixTrainerBase):
    """Reward-model training with prefix sharing; TRL `RewardTrainer`-shaped constructor.

    model:        an `AutoModelForSequenceClassification` with num_labels=1, or a name/path (a causal-LM
                  checkpoint gets a new score head, as in TRL).
    train_dataset / eval_dataset: a list of `Example`s (`meta["margin"]` optional), or records / a
                  `datasets.Dataset` / a path (with an optional `margin` column); eval may be a dict.
    peft_config:  a `peft` config (`LoraConfig(task_type="SEQ_CLS")`: the score head trains fully).
    """

    def __init__(self, model=None, args: PrefixRewardConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, data_options=None, callbacks=None,
                 optimizers=(None, None)):
        args, backend = self._checked_args(args, PrefixRewardConfig)
        # the pass backend: `STOCK` (the model's own attention) for a model prefix sharing off runs as TRL does
        model, processing_class, backend = prepare_reward_model(
            model, args, backend=backend, peft_config=peft_config, tokenizer=processing_class)
        tokens_per_pass = resolve_tokens_per_pass(args, model)  # prefix reuse's budget, or None
        train, evals = self._examples_that_fit(model, args, backend, data_options or reward_data_options(args),
                                               train_dataset, eval_dataset, processing_class)
        super().__init__(model=model, args=args, data_collator=None, train_dataset=train, eval_dataset=evals,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers)
        self._init_run_state(backend, tokens_per_pass)

    def _as_examples(self, data, tokenizer, name: str):
        return reward_examples(data, tokenizer, self._data_options, name, self.data_reports)

    def _new_metric_sums(self) -> RewardMetricSums:
        return RewardMetricSums()

    # ---- loss -------------------------------------------------------------------------------

    def _pair_step(self, model, inputs: MicroBatch, split: str):
        """(per-pair losses [P], or None for a rank-balancing empty micro-batch, and the scores); adds the
        micro-batch's metric sums to `split`."""
        batch = inputs.batch.to(self.args.device)
        mask = plan_run_pass(batch, self.sharing.backend, max_tokens_per_pass=self.sharing.tokens_per_pass)
        scores = compute_response_scores(model, batch, mask)
        if batch.num_pairs == 0:
            return None, scores
        margins = inputs.margins
        losses = pair_reward_losses(scores, batch.pair_better, batch.pair_worse,
                                    None if margins is None else margins.to(scores.device),
                                    self.args.center_rewards_coefficient)
        stats = pair_metric_values(scores, batch.pair_better, batch.pair_worse)
        stats.update(pairs=batch.num_pairs, loss_sum=losses.detach().sum().item(), **inputs.token_counts())
        self._metrics[split].add(stats)
        return losses, scores

    def _compute_loss(self, model, inputs, return_outputs):
        losses, scores = self._pair_step(model, inputs, "train")
        if losses is None:
            loss = scores.sum() * 0.0  # the empty slot still runs the model and joins the gradient sync
        else:
            # x world size: DDP/FSDP/DeepSpeed average gradients over ranks; we want the sum over ranks of
            # (pair losses / all pairs of the step)
            loss = losses.sum() * self._step_share(inputs)
        return (loss, {"scores": scores}) if return_outputs else loss
