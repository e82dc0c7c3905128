"""Tiny reward models (sequence classifiers, one label) built from configs, for the reward tests."""

from __future__ import annotations

import torch

from conftest import TINY


def tiny_reward_model(arch: str = "llama", pad_token_id: int = 0, **overrides):
    """A tiny fp32 `AutoModelForSequenceClassification` (num_labels=1) of `arch`, seeded, in eval mode."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    kwargs = dict(TINY, num_labels=1, pad_token_id=pad_token_id)
    if arch in ("qwen2", "qwen3", "mistral", "llama"):
        kwargs["num_key_value_heads"] = 2  # GQA
    if arch == "qwen3":
        kwargs["head_dim"] = 8
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(arch, **kwargs), dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init, so a wrong layout shows clearly in the scores
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.train(False)
