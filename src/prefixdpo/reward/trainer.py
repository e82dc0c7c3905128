"""`PrefixRewardTrainer`: Bradley-Terry reward-model training on prefix-shared rows, on `transformers.Trainer`.

The data path is the DPO trainer's: records -> Examples (every format, pairs policy, validation) ->
per-epoch micro-batch plans (padded or packed lines, the same number of micro-batches on every rank,
re-planned each epoch by `PrefixDPOCallback`) -> `Batch`. Per micro-batch, one pass of the reward model
scores every response of every example once (`scores.compute_response_scores`); each preference pair
the pairs policy names gives one loss term (`losses.pair_reward_losses`).

Gradient normalisation is the DPO trainer's: a micro-batch's loss is ``sum(pair losses) * W / N`` with N
the pairs of the whole optimizer step over all W ranks (known from the plan), so every step's gradient
is that of the mean pair loss of the step, however packing, accumulation and ranks split it. TRL averages
micro-batch means instead; the two agree when micro-batches hold equal pair counts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping

import torch
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

from prefixdpo.attention.backends import resolve_backend
from prefixdpo.callbacks import PrefixDPOCallback, latest_checkpoint
from prefixdpo.data.loader import MicroBatches, make_dataloader
from prefixdpo.engines import enable_requested_fsdp, whole_model_state_dict
from prefixdpo.errors import UserError
from prefixdpo.forward import restore_stock_attention, unwrap
from prefixdpo.offloading import activation_offloading_context
from prefixdpo.reward.config import PrefixRewardConfig, reward_data_options
from prefixdpo.reward.data import pair_margins, reward_examples
from prefixdpo.reward.losses import RewardMetricSums, pair_metric_values, pair_reward_losses
from prefixdpo.reward.model import prepare_reward_model
from prefixdpo.reward.scores import compute_response_scores
from prefixdpo.training_data import loader_settings, pad_token_id

__all__ = ["PrefixRewardTrainer"]


class RewardCallback(PrefixDPOCallback):
    """The DPO trainer's callback (epoch re-planning, throughput without set-up time, a non-finite loss
    stopped before the optimizer applies it); a reward model keeps no per-checkpoint state of its own."""

    def on_save(self, args, state, control, **kwargs):
        return None


class _WithMargins(torch.utils.data.Dataset):
    """A `MicroBatches` whose items also carry `margins` ([P] or None) of their pairs."""

    def __init__(self, micro: MicroBatches):
        self.micro = micro

    def __len__(self) -> int:
        return len(self.micro)

    def __getitem__(self, m: int) -> dict:
        item = self.micro[m]
        item["margins"] = pair_margins(self.micro.examples, item["example_ids"])
        return item


class PrefixRewardTrainer(Trainer):
    """Reward-model training with prefix sharing; TRL `RewardTrainer`-shaped constructor.

    model:        an `AutoModelForSequenceClassification` with num_labels=1, or a name/path (a causal-LM
                  checkpoint gets a new score head, as in TRL).
    train_dataset / eval_dataset: a list of `Example`s (`meta["margin"]` optional), or records / a
                  `datasets.Dataset` / a path (with an optional `margin` column); eval may be a dict.
    peft_config:  a `peft` config (`LoraConfig(task_type="SEQ_CLS")`: the score head trains fully).
    """

    loss_is_scaled_for_ga = True  # compute_loss divides by the step's pairs already (module docstring)

    def __init__(self, model=None, args: PrefixRewardConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, data_options=None, callbacks=None,
                 optimizers=(None, None)):
        args = args if args is not None else PrefixRewardConfig()
        if not isinstance(args, PrefixRewardConfig):
            raise TypeError("args must be a PrefixRewardConfig")
        self.backend = resolve_backend(args.attention, args.device, needs_grad=True)
        logging.getLogger(__name__).info("attention backend: %s (attention=%s)", self.backend, args.attention)
        model, processing_class = prepare_reward_model(model, args, backend=self.backend, peft_config=peft_config,
                                                       tokenizer=processing_class)
        self._data_options = data_options or reward_data_options(args)
        self.data_reports: dict = {}
        train = self._examples(train_dataset, processing_class, "train")
        if isinstance(eval_dataset, Mapping):
            evals = {key: self._examples(data, processing_class, f"eval_{key}") for key, data in eval_dataset.items()}
        else:
            evals = self._examples(eval_dataset, processing_class, "eval")
        super().__init__(model=model, args=args, data_collator=None, train_dataset=train, eval_dataset=evals,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers)
        self.add_callback(RewardCallback(self))
        self._offload = activation_offloading_context(self.model, args.activation_offloading)
        self._metrics = {"train": RewardMetricSums(), "eval": RewardMetricSums()}
        self._pairs_trained = 0.0
        self._nonfinite_loss = None  # set by training_step, checked by the callback before the optimizer step
        self._train_micro: MicroBatches | None = None
        self.engine_description = "not started"  # set by the callback when training begins

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        enable_requested_fsdp(self)  # as the DPO trainer: accelerate drops a requested FSDP on CPU

    def _examples(self, data, tokenizer, name: str):
        return reward_examples(data, tokenizer, self._data_options, name, self.data_reports)

    # ---- data -------------------------------------------------------------------------------

    @property
    def pad_token_id(self) -> int:
        return pad_token_id(self.processing_class)

    def _micro_batches(self, examples, *, train: bool) -> MicroBatches:
        size = self._train_batch_size if train else self.args.per_device_eval_batch_size
        settings = loader_settings(self.args, train=train, batch_size=size, pad_token=self.pad_token_id,
                                   backend=self.backend)
        return MicroBatches(examples, settings, rank=self.args.process_index, world_size=self.args.world_size)

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise UserError("PrefixRewardTrainer: training needs a train_dataset")
        self._train_micro = self._micro_batches(self.train_dataset, train=True)
        pin = self.args.dataloader_pin_memory and torch.cuda.is_available()
        return make_dataloader(_WithMargins(self._train_micro), self.args.dataloader_num_workers, pin)

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is None and self.eval_dataset is None:
            raise UserError("PrefixRewardTrainer: evaluation needs an eval_dataset")
        if isinstance(eval_dataset, str):
            examples = self.eval_dataset[eval_dataset]
        elif eval_dataset is not None:
            examples = self._examples(eval_dataset, self.processing_class, "eval")
        else:
            examples = self.eval_dataset
        return make_dataloader(_WithMargins(self._micro_batches(examples, train=False)))

    # ---- loss -------------------------------------------------------------------------------

    def _score_step(self, model, inputs: dict, split: str):
        """(per-pair losses [P], or None for a rank-balancing empty micro-batch, and the scores); adds the
        micro-batch's metric sums to `split`."""
        batch = inputs["batch"].to(self.args.device)
        scores = compute_response_scores(model, batch, backend=self.backend)
        if batch.num_pairs == 0:
            return None, scores
        margins = inputs.get("margins")
        losses = pair_reward_losses(scores, batch.pair_better, batch.pair_worse,
                                    None if margins is None else margins.to(scores.device),
                                    self.args.center_rewards_coefficient)
        stats = pair_metric_values(scores, batch.pair_better, batch.pair_worse)
        stats.update(pairs=batch.num_pairs, loss_sum=losses.detach().sum().item(),
                     **{k: inputs[k] for k in ("real_tokens", "slots", "shared_tokens", "unshared_tokens")})
        self._metrics[split].add(stats)
        return losses, scores

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self._offload:  # activation_offloading (TRL's context; a no-op when off)
            losses, scores = self._score_step(model, inputs, "train")
        if losses is None:
            loss = scores.sum() * 0.0  # the empty slot still runs the model and joins the gradient sync
        else:
            # x world size: DDP/FSDP/DeepSpeed average gradients over ranks; we want the sum over ranks of
            # (pair losses / all pairs of the step)
            loss = losses.sum() * (self.accelerator.num_processes / max(int(inputs["step_pairs"]), 1))
        return (loss, {"scores": scores}) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not torch.isfinite(loss):
            self._nonfinite_loss = float(loss)
        return loss

    # ---- evaluation and logging -------------------------------------------------------------

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        # every pair weighs the same, whatever micro-batch it is in (Trainer's loop would concatenate logits)
        model = self._wrap_model(self.model, training=False, dataloader=dataloader)
        mode = model.training
        model.eval()
        self._metrics["eval"] = sums = RewardMetricSums()
        with torch.no_grad():
            for inputs in dataloader:
                self._score_step(model, inputs, "eval")
        model.train(mode)
        pairs = int(sums.reduced(self.accelerator)["pairs"])
        metrics = sums.summary(self.accelerator, prefix=f"{metric_key_prefix}_", with_loss=True)
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=pairs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # every rank reaches a log together, so the reductions inside `summary` are safe
        train = self._metrics["train"]
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            logs = {**logs, **train.summary(self.accelerator)}
            self._pairs_trained += train.last_pairs
        if "train_runtime" in logs:  # a sample here is a pair, not a micro-batch
            train.summary(self.accelerator)
            self._pairs_trained += train.last_pairs
            logs["train_samples_per_second"] = round(self._pairs_trained / max(logs["train_runtime"], 1e-9), 3)
        super().log(logs, start_time)

    def floating_point_ops(self, inputs) -> int:
        # 6 x parameters x real tokens (forward + backward), the usual estimate
        if not isinstance(inputs, Mapping):
            return 0
        return 6 * sum(p.numel() for p in unwrap(self.model).parameters()) * int(inputs.get("real_tokens", 0))

    # ---- train / save -----------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """Trainer.train, where `resume_from_checkpoint="latest"` resumes from the newest checkpoint-* folder."""
        latest = resume_from_checkpoint == "latest"
        return super().train(latest_checkpoint(self.args.output_dir) if latest else resume_from_checkpoint,
                             *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # checkpoints stay as the engine is configured; an export is one whole, stock-loadable model
        with contextlib.nullcontext() if _internal_call else whole_model_state_dict(self):
            super().save_model(output_dir, _internal_call)
        if self.args.should_save:  # the saved config names stock attention: loadable without prefixdpo
            restore_stock_attention(output_dir if output_dir is not None else self.args.output_dir)
