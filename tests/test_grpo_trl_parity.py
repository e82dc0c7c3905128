"""`PrefixGRPOTrainer` == TRL 1.16's `GRPOTrainer` and `PrefixRLOOTrainer` == `RLOOTrainer`, run for run.

Same saved tiny model, tokenizer, prompts (a long shared instruction), reward, seed and options; TRL samples
the completions in both runs (transformers generate, seeded). Asserted over 4 optimizer steps at a learning rate
that moves the weights (the final weights are far from the initial ones, and clip ratios leave 0):
- every step's completions are the same token ids in both runs (the comparison is of the same rollouts);
- every per-step metric TRL logs agrees (`tolerances`): what the same completions decide (rewards, reward_std,
  per-function rewards, completion lengths, token counts, and the clip ratios, fractions of tokens) exactly; loss,
  kl and entropy, token means of functions of per-token log-probs with O(1) slopes here (advantages of unit std,
  ratios near 1, beta <= 0.04, the kl's e^d - 1 with d = ref - logp of order 1), within K eps x the per-token
  log-prob scale, which the logged entropy is (the mean -log p of sampled tokens): a loss whose advantage-weighted
  terms cancel to ~1e-8 still carries its log-probs' rounding; grad_norm within K eps of itself;
- the final weights agree within K eps x `weights_scale` (the largest weight plus the largest change);
- prefix sharing really ran (`prefix_sharing/tokens_saved` > 0 in every logged step).
GRPO: loss_type dapo, grpo, dr_grpo, and GSPO's sequence-level importance sampling; beta 0 and 0.04; num_iterations
1 and 2; packing on and off; G = 2, 4, 8 (G = 8 over two accumulation steps, so a micro-batch holds part of a group);
gradient checkpointing (TRL's default) in one case.
RLOO: two configurations. The worst metric difference in eps x its scale is printed as a REPORT line (-s). About
2.5 s per case on 2 cores (one torch thread).
"""

from __future__ import annotations

import pytest
import torch
from grpo_common import prompt_dataset, reward_vowels, saved_tiny_model, tokenizer
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer, PrefixRLOOConfig, PrefixRLOOTrainer
from tolerances import K_FORWARD, assert_within, weights_scale

OURS_ONLY = ("prefix_sharing/", "packing/")
NOT_COMPARED = ("step_time", "epoch", "step")
LOGP_METRICS = ("loss", "kl", "entropy")  # token means of functions of per-token log-probs; the rest but grad_norm:
# decided by the completions (equal in both runs)
# SGD, not AdamW: Adam divides each entry's gradient by its own running magnitude, so an entry whose gradient is
# ~0 (terms cancelling) moves by a learning-rate-sized step whose sign is rounding noise, in TRL's run as in ours;
# that would compare Adam's sensitivity, not the log-prob passes. SGD moves the weights by the gradients themselves.
LR = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def run(trainer_cls, config_cls, model_dir, out_dir, reward=reward_vowels, **options):
    """Train 4 steps with `reward` (called as TRL calls reward functions); return (logged step metrics, completion
    ids of every reward call, initial and final weights)."""
    torch.set_num_threads(1)  # a tiny model gains nothing from a second thread (conftest's fixture restores it)
    rollouts = []

    def reward_vowel_share(completions, completion_ids, **kwargs):
        rollouts.append([list(ids) for ids in completion_ids])
        return reward(completions=completions, completion_ids=completion_ids, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    options = {"gradient_checkpointing": False, **options}
    args = config_cls(output_dir=str(out_dir), max_steps=4, logging_steps=1, learning_rate=LR, optim="sgd",
                      lr_scheduler_type="constant", use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      seed=0, disable_tqdm=True, max_completion_length=10, **options)
    trainer = trainer_cls(model=model, reward_funcs=reward_vowel_share, args=args, train_dataset=prompt_dataset(32),
                          processing_class=tokenizer())
    trainer.train()
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return [h for h in trainer.state.log_history if "loss" in h], rollouts, initial, final


def metric_within(key: str, a: float, b: float, step: dict) -> float:
    """One logged metric of two runs' same step `step` (a's log) agrees as the module doc says; our own counting
    metrics (`OURS_ONLY`: fractions of tokens) within K_FORWARD eps of 1. Returns the difference in eps x scale."""
    what = f"step {step['step']} {key}"
    if key in LOGP_METRICS or key == "grad_norm":
        return assert_within(b, a, a if key == "grad_norm" else float(step["entropy"]), what=what)
    if key.startswith(OURS_ONLY):
        return assert_within(b, a, 1.0, k=K_FORWARD, what=what)
    assert a == b, (key, a, b)
    return 0.0


def compare(theirs, ours):
    """Assert TRL's and our runs agree (see the module doc); return the worst float metric difference in units of
    eps x its scale."""
    logs_t, rollouts_t, initial, final_t = theirs
    logs_o, rollouts_o, _, final_o = ours
    assert rollouts_t == rollouts_o and len(rollouts_t) >= 2
    assert len(logs_t) == len(logs_o) == 4
    worst = 0.0
    for step_t, step_o in zip(logs_t, logs_o):
        assert step_o["prefix_sharing/tokens_saved"] > 0.0
        keys = {k for k in step_t if k not in NOT_COMPARED}
        assert keys == {k for k in step_o if k not in NOT_COMPARED and not k.startswith(OURS_ONLY)}
        for key in keys:
            worst = max(worst, metric_within(key, float(step_t[key]), float(step_o[key]), step_t))
    moved = max((final_t[n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 0.01  # the weights moved
    flat_t, flat_o, flat_0 = (torch.cat([w[n].flatten() for n in initial]) for w in (final_t, final_o, initial))
    assert_within(flat_o, flat_t, weights_scale(flat_0, flat_t), what="final weights")
    return worst


GRPO_CASES = {
    "dapo-beta0-iter1-packed-G4-checkpointing": dict(loss_type="dapo", beta=0.0, num_iterations=1, packing=True,
                                                    num_generations=4, per_device_train_batch_size=4,
                                                    gradient_checkpointing=True),
    "grpo-beta-iter2-unpacked-G2": dict(loss_type="grpo", beta=0.04, num_iterations=2, packing=False,
                                        num_generations=2, per_device_train_batch_size=4),
    "dr_grpo-beta-iter1-packed-G8": dict(loss_type="dr_grpo", beta=0.04, num_iterations=1, packing=True,
                                         num_generations=8, per_device_train_batch_size=4,
                                         gradient_accumulation_steps=2),
    "gspo-beta0-iter2-packed-G4": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.0,
                                       num_iterations=2, packing=True, num_generations=4,
                                       per_device_train_batch_size=4),
}


def _trl_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k != "packing"}


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_equals_trl(case, model_dir, tmp_path):
    options = GRPO_CASES[case]
    theirs = run(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **_trl_options(options))
    ours = run(PrefixGRPOTrainer, PrefixGRPOConfig, model_dir, tmp_path / "ours", **options)
    worst = compare(theirs, ours)
    print(f"REPORT grpo {case}: worst metric difference {worst:.2f} eps x its scale")
    if options["num_iterations"] > 1:  # the second iteration's ratios move off 1 and get clipped
        assert any(step.get("clip_ratio/region_mean", 0) > 0 for step in theirs[0])


RLOO_CASES = {
    "beta0-iter1-packed-G4": dict(beta=0.0, num_iterations=1, packing=True, num_generations=4,
                                  per_device_train_batch_size=4),
    "beta-iter2-unpacked-G2": dict(beta=0.04, num_iterations=2, packing=False, num_generations=2,
                                   per_device_train_batch_size=4),
}


@pytest.mark.parametrize("case", list(RLOO_CASES))
def test_rloo_equals_trl(case, model_dir, tmp_path):
    options = RLOO_CASES[case]
    theirs = run(RLOOTrainer, RLOOConfig, model_dir, tmp_path / "trl", **_trl_options(options))
    ours = run(PrefixRLOOTrainer, PrefixRLOOConfig, model_dir, tmp_path / "ours", **options)
    worst = compare(theirs, ours)
    print(f"REPORT rloo {case}: worst metric difference {worst:.2f} eps x its scale")
