"""The tiny random models the exactness checks of `make gpu-check` run on (DPO and GRPO sections alike)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the models are built: `gpu-check --help` stays light
    import torch


def tiny_causal_lm(arch: str, dtype: torch.dtype, device: str):
    """A tiny random model of `arch` (GQA where the architecture has it; Gemma-2 keeps its default
    soft-capping). Initialised at std 0.2 so a wrong layout shows in the log-probs, then cast."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kwargs), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.to(device=device, dtype=dtype).train(False)
