"""`prefixdpo bench --task reward`: the reward-model step (Bradley-Terry, as TRL's `RewardTrainer`) in the
four layouts, and its ideal speedup.

A reward-model step is the model's forward + backward and AdamW: no reference pass and no LM head (the
score head is one `hidden x 1` product per response, not counted). So its useful FLOPs are the body's
matmuls and attention over allowed query-key pairs only, and the ideal speedup of prefix sharing is the
ratio of those: standard training runs each pair as two `[prompt][response]` sequences (K = 4 responses
best-vs-each: 6 sequences), prefix sharing the prompt once and every response once. Without the LM
head's per-response cost, which sharing does not shrink as much as the prompt, the ideal is a little
higher than DPO's on the same examples.
"""

from __future__ import annotations

import torch

from prefixdpo.core.attention.backends import resolve_backend
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.data.batch import Batch
from prefixdpo.data.example import Example
from prefixdpo_tools.bench.flops import FlopCount, ModelShape, shared_flop_count, standard_flop_count
from prefixdpo.reward.losses import pair_reward_losses
from prefixdpo.core.scores import compute_response_scores

__all__ = ["RewardStep", "build_reward_model", "reward_ideal_speedup", "reward_flop_split"]


def no_head(count: FlopCount) -> FlopCount:
    return FlopCount(count.body, count.attention, 0)


def reward_ideal_speedup(shape: ModelShape, examples: list[Example]) -> float:
    """Useful FLOPs of standard reward training / of prefix sharing on `examples` (body + attention)."""
    standard = sum(no_head(standard_flop_count(shape, ex)).total for ex in examples)
    shared = sum(no_head(shared_flop_count(shape, ex)).total for ex in examples)
    return standard / shared


def reward_flop_split(shape: ModelShape, examples: list[Example], *, shared: bool) -> dict[str, float]:
    """Shares of body, attention (and a zero LM head) in the useful FLOPs of the workload."""
    count = FlopCount(0, 0, 0)
    for ex in examples:
        count = count + no_head(shared_flop_count(shape, ex) if shared else standard_flop_count(shape, ex))
    return {"body": count.body / count.total, "attention": count.attention / count.total, "lm_head": 0.0}


def build_reward_model(model: str | ModelShape, *, device: str, dtype: torch.dtype, backend: str, seed: int = 0,
                       trust_remote_code: bool = False):
    """(reward model, ModelShape): a random-init Llama-shaped sequence classifier (num_labels=1) of `model`'s
    shape, or a checkpoint loaded as one; prepared for prefixdpo's attention, training mode."""
    from transformers import AutoModelForSequenceClassification

    from prefixdpo_tools.bench.model import llama_config
    from prefixdpo.core.model_checks import prepare_model
    from prefixdpo.reward.model import load_reward_model

    torch.manual_seed(seed)
    if isinstance(model, ModelShape):
        config = llama_config(model)
        config.num_labels = 1
        reward = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    else:
        reward = load_reward_model(model, dtype=dtype, trust_remote_code=trust_remote_code, seed=seed)
    cfg = reward.config.get_text_config()
    if cfg.pad_token_id is None:
        cfg.pad_token_id = cfg.eos_token_id if cfg.eos_token_id is not None else 0
    reward.to(device).train()
    prepare_model(reward, backend)
    return reward, ModelShape.from_config(reward.config)


class RewardStep:
    """One optimizer step per call: `step(batch) -> loss` (mean Bradley-Terry loss over the batch's pairs):
    one scoring pass with grad, backward, AdamW. The same code for every mode."""

    def __init__(self, model, *, backend: str, lr: float = 1e-6):
        self.model = model
        self.backend = resolve_backend(backend, next(model.parameters()).device, needs_grad=True)
        params = [p for p in model.parameters() if p.requires_grad]
        try:  # fused: one kernel per step (a fixed cost would dilute the layout differences measured)
            self.optimizer = torch.optim.AdamW(params, lr=lr, fused=True)
        except (RuntimeError, ValueError):
            self.optimizer = torch.optim.AdamW(params, lr=lr)

    def step(self, batch: Batch) -> float:
        mask = plan_pass(batch, self.backend)  # built in the step: timed
        scores = compute_response_scores(self.model, batch, mask)
        loss = pair_reward_losses(scores, batch.pair_better, batch.pair_worse).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())
