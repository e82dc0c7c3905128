"""Per-step equality with TRL 1.16's `RewardTrainer`: the same tiny reward model, records and order
(`train_sampling_strategy="sequential"`), fp32 on CPU. TRL runs `[prompt][chosen]` and `[prompt][rejected]`
padded rows through the stock model; we run one prefix-shared row per record and score both responses
from it. The logged values agree within `test_reward_trainer.assert_same_reward_log` at K eps x the scores'
rounding scale |w| |h| (K, as after Adam steps: Adam turns rounding in a gradient entry near 0 into a step of up to
lr, so the scores can drift apart by more than one forward's rounding), accuracy exactly (ties are checked to be absent), for
standard and conversational records, with a `margin` column and reward centering on."""

from __future__ import annotations

import copy

import pytest

from test_reward_scores import tiny_reward_model
from test_reward_trainer import assert_same_reward_log
from test_trl_parity import parity_setup
from tolerances import K

KEYS = ("loss", "grad_norm", "margin", "mean_reward", "min_reward", "max_reward")


def options(tmp_path, name: str) -> dict:
    return dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, num_train_epochs=1,
                train_sampling_strategy="sequential", learning_rate=1e-3, lr_scheduler_type="constant",
                optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, seed=0, bf16=False,
                gradient_checkpointing=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                max_length=512, center_rewards_coefficient=0.01, disable_dropout=True)


def conversational(records: list[dict]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
             "rejected": [{"role": "assistant", "content": r["rejected"].strip()}],
             "margin": r["margin"]} for r in records]


def run_trl(records, tokenizer, model, opts):
    import datasets
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(pad_to_multiple_of=None, **opts)
    trainer = RewardTrainer(model=copy.deepcopy(model), args=args, processing_class=tokenizer,
                            train_dataset=datasets.Dataset.from_list(records))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def run_ours(records, tokenizer, model, opts):
    """Our per-step logs, and the smallest |r_chosen - r_rejected| seen (accuracy is compared only away from ties)."""
    from prefixdpo import PrefixRewardConfig, PrefixRewardTrainer

    gaps = []

    class Recording(PrefixRewardTrainer):
        def _pair_step(self, model, inputs, split):
            losses, scores = super()._pair_step(model, inputs, split)
            batch = inputs.batch
            gaps.append((scores[batch.pair_better] - scores[batch.pair_worse]).detach().abs().min().item())
            return losses, scores

    args = PrefixRewardConfig(prefix_sharing=True, attention="sdpa", **opts)
    trainer = Recording(model=copy.deepcopy(model), args=args, processing_class=tokenizer, train_dataset=records)
    assert trainer.data_reports["train"].kept == len(records)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], min(gaps)


@pytest.mark.parametrize("form", ["standard", "conversational"])
def test_per_step_metrics_equal_trl_reward_trainer(tmp_path, form):
    records, tokenizer, _ = parity_setup()  # TRL or skip, progress bars off, the tiny tokenizer
    records = [{**r, "margin": 0.25 * (i % 3)} for i, r in enumerate(records)]
    if form == "conversational":
        records = conversational(records)
    model = tiny_reward_model("llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    trl_logs = run_trl(records, tokenizer, model, options(tmp_path, "trl"))
    ours, closest = run_ours(records, tokenizer, model, options(tmp_path, "ours"))
    assert closest > 1e-3  # no pair near a tie: accuracy (a step function) can be compared exactly
    assert len(trl_logs) == len(ours) == 4
    table = "\n".join(f"step {s} {k:12s} trl {t[k]: .8f} ours {o[k]: .8f}"
                      for s, (t, o) in enumerate(zip(trl_logs, ours), 1) for k in KEYS + ("accuracy",))
    for step, (t, o) in enumerate(zip(trl_logs, ours), 1):
        assert_same_reward_log(o, t, model, k=K, what=f"step {step}\n{table}\n")
        assert o["accuracy"] == t["accuracy"], table
    assert len({round(o["margin"], 6) for o in ours}) == 4, table  # training moved the scores every step
