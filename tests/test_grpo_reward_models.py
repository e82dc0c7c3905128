"""Reward models as GRPO/RLOO reward functions, scored prefix-shared (`grpo/reward_models.py`) == TRL's scores.

The unit test compares with the stock model on TRL's right-padded rows (fp32; within K_FORWARD eps of the scores'
rounding scale |w| |h|, `test_reward_scores.score_scale`); the trainer test runs TRL's `GRPOTrainer` / `RLOOTrainer` and ours with a
tiny reward model in float64 (so the sampled completions compare token for token, see test_grpo_generation.py) and
compares every logged reward metric within 1e-9 relative (float64 scores are ~1e-16 apart; the metrics are means
and standard deviations of O(1) scores over 8 rows).
"""

from __future__ import annotations

import logging

import pytest
import torch
from grpo_common import prompt_dataset, saved_tiny_model, tokenizer
from test_reward_scores import score_scale, tiny_reward_model
from transformers import AutoModelForCausalLM

from prefixdpo.core.model_checks import prepare_model
from prefixdpo.grpo.reward_models import group_examples, shared_reward_scores
from tolerances import K_FORWARD, assert_within

SYSTEM = [11, 12, 13, 14, 15]


def reward_rows(seed=0):
    """TRL's reward rows: `prompt + completion` tokens right-padded; three prompts (a shared system prompt, lengths
    3 / 7 / 5 after it), four, three and one completion (a group of one: a micro-batch holding part of a group);
    one completion of a single token. -> (input_ids [N, L], attention_mask [N, L], groups [N])."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(16, 90, (n,), generator=g).tolist()

    prompts = [SYSTEM + ids(3), SYSTEM + ids(7), SYSTEM + ids(5)]
    spec = [(0, 4), (0, 9), (0, 1), (0, 6), (1, 3), (1, 3), (1, 8), (2, 5)]
    rows = [(p, prompts[p] + ids(n)) for p, n in spec]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]  # any order: groups say who is who
    L = max(len(r) for _, r in rows)
    input_ids = torch.tensor([r + [0] * (L - len(r)) for _, r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (L - len(r)) for _, r in rows])
    return input_ids, mask, [p for p, _ in rows]


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("backend", ["sdpa", "segmented"])
def test_shared_scores_equal_the_model_on_trl_rows(packing, backend):
    model = tiny_reward_model(pad_token_id=0)
    input_ids, mask, groups = reward_rows()
    with torch.no_grad():
        theirs = model(input_ids=input_ids, attention_mask=mask).logits[:, 0]
        prepare_model(model, backend)
        ours = shared_reward_scores(model, input_ids, mask, groups, backend=backend, packing=packing)
    assert ours.shape == theirs.shape
    assert_within(ours, theirs, score_scale(model), k=K_FORWARD, what="shared scores")
    assert theirs.std() > 0.1  # the rows score differently: a mix-up of rows would show


def test_groups_become_examples_with_the_shared_prompt():
    input_ids, mask, groups = reward_rows()
    examples, rows_of = group_examples(input_ids, mask, groups)
    assert sorted(i for idx in rows_of for i in idx) == list(range(len(groups)))
    for ex, idx in zip(examples, rows_of):
        rows = [input_ids[i][mask[i].bool()].tolist() for i in idx]
        assert all(list(ex.prompt_ids) + list(r) == row for r, row in zip(ex.response_ids, rows))
    by_size = sorted(examples, key=lambda e: len(e.prompt_ids))
    # the one-token completion caps its group's prompt one short of it; the group of one repeats its last token
    assert any(len(ex.response_ids) == 2 and ex.response_ids[0] == ex.response_ids[1] for ex in examples)
    assert all(len(ex.prompt_ids) >= len(SYSTEM) for ex in by_size)
    assert group_examples(torch.tensor([[5, 0], [6, 7]]), torch.tensor([[1, 0], [1, 1]]), [0, 1]) is None


# ---- through the trainers, against TRL's own -------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny-rm") / "model")


def run(trainer_cls, config_cls, model_dir, out_dir, **options):
    torch.set_num_threads(1)
    tok = tokenizer()
    rollouts = []

    def length_bonus(completions, completion_ids, **kwargs):  # a second reward: records the completions
        rollouts.append([list(ids) for ids in completion_ids])
        return [0.01 * len(ids) for ids in completion_ids]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    scorer = tiny_reward_model(pad_token_id=tok.pad_token_id, vocab_size=len(tok)).double()
    args = config_cls(output_dir=str(out_dir), max_steps=2, logging_steps=1, learning_rate=0.5, optim="sgd",
                      lr_scheduler_type="constant", use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      seed=0, disable_tqdm=True, max_completion_length=8, gradient_checkpointing=False,
                      num_generations=4, per_device_train_batch_size=8, beta=0.0, **options)
    trainer = trainer_cls(model=model, reward_funcs=[scorer, length_bonus], args=args,
                          train_dataset=prompt_dataset(32), processing_class=tok, reward_processing_classes=[tok, None])
    trainer.train()
    return rollouts, [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_trainer_reward_model_scores_equal_trl_float64(method, model_dir, tmp_path, caplog, monkeypatch):
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    import prefixdpo.grpo.reward_models as reward_models
    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer, PrefixRLOOConfig, PrefixRLOOTrainer

    calls = []
    real = reward_models.shared_reward_scores
    monkeypatch.setattr(reward_models, "shared_reward_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    theirs_cls, ours_cls = ((GRPOTrainer, GRPOConfig), (PrefixGRPOTrainer, PrefixGRPOConfig)) if method == "grpo" \
        else ((RLOOTrainer, RLOOConfig), (PrefixRLOOTrainer, PrefixRLOOConfig))
    rollouts_t, logs_t = run(*theirs_cls, model_dir, tmp_path / "trl")
    assert calls == []
    with caplog.at_level(logging.WARNING, logger="prefixdpo.grpo"):
        rollouts_o, logs_o = run(*ours_cls, model_dir, tmp_path / "ours")
    assert not [r for r in caplog.records if "shared-prompt" in r.getMessage()]
    assert len(calls) == 2  # one shared scoring call per step
    assert rollouts_t == rollouts_o
    keys = [k for k in logs_t[0] if k.startswith("rewards/") or k in ("reward", "reward_std")]
    assert any("/mean" in k and "length_bonus" not in k for k in keys)
    for step_t, step_o in zip(logs_t, logs_o):
        for key in keys:
            a, b = step_t[key], step_o[key]
            assert abs(a - b) <= 1e-9 * max(1.0, abs(a)), (key, a, b)


def test_reward_funcs_name_a_reward_model(tmp_path):
    from prefixdpo.errors import ConfigError
    from prefixdpo.grpo.rewards import resolve_rewards

    folder = tmp_path / "rm"
    tiny_reward_model().save_pretrained(folder)
    rewards = resolve_rewards([str(folder), "org/reward-model", "think_format_reward"], None)
    assert rewards[:2] == [str(folder), "org/reward-model"] and callable(rewards[2])  # TRL loads the names
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="without a saved model"):
        resolve_rewards([str(tmp_path / "empty")], None)
    with pytest.raises(ConfigError, match="no module named"):
        resolve_rewards(["no_such_module:f"], None)
