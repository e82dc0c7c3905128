"""The benchmark's models: a Llama-shaped default scaled down from Llama-3.1-8B, or a real one.

Scaling down keeps Llama-3.1-8B's proportions where they set the cost structure: SwiGLU MLP of
3.5 x hidden, grouped-query attention with 4 query heads per KV head, head_dim 64..128, and a
vocabulary small enough that the LM head costs about what it costs the 8B model relative to the
body per token (8B: 4096 x 128256 head vs 6.98 G body weights, 0.075). So, as in the real model, the
transformer body (not the vocabulary) dominates the FLOPs; the report states the exact split on each
workload.
"""

from __future__ import annotations

import copy

import torch

from prefixdpo_tools.bench.flops import ModelShape

__all__ = ["DEFAULT_SHAPE", "QUICK_SHAPE", "MEDIUM_SHAPE", "SHAPES", "llama_config", "build_models"]

# hidden, intermediate (3.5 x), layers, heads, kv heads (GQA), head_dim 64, vocab: LM head / body weights
# per token = 0.074 for both (Llama-3.1-8B: 0.075). Small because 2 CPU cores in fp32 must run all six
# profiles x four modes in minutes; the FLOP split on each workload is printed with the results.
DEFAULT_SHAPE = ModelShape(hidden=128, intermediate=448, layers=4, heads=2, kv_heads=1, head_dim=64, vocab=512)
QUICK_SHAPE = ModelShape(hidden=128, intermediate=448, layers=2, heads=2, kv_heads=1, head_dim=64, vocab=256)
# A larger Llama-shaped option (--model-size medium) for machines with more time.
MEDIUM_SHAPE = ModelShape(hidden=512, intermediate=1792, layers=8, heads=8, kv_heads=2, head_dim=64, vocab=4096)
SHAPES = {"default": DEFAULT_SHAPE, "quick": QUICK_SHAPE, "medium": MEDIUM_SHAPE}

def llama_config(shape: ModelShape, max_positions: int = 16384):
    """A LlamaConfig with `shape`'s dimensions (random init; nothing is downloaded)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab, max_position_embeddings=max_positions, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def build_models(model: str | ModelShape, *, device: str, dtype: torch.dtype, backend: str,
                 seed: int = 0, trust_remote_code: bool = False):
    """(policy, reference, ModelShape): two equal copies, prepared for prefixdpo's attention.

    model: a ModelShape (random-init Llama) or a path / hub name for `AutoModelForCausalLM`.
    The reference is frozen and in eval mode; the policy trains (dropout stays 0 in Llama configs).
    """
    from prefixdpo.core.model_checks import prepare_model
    from prefixdpo.core.models import load_causal_lm

    torch.manual_seed(seed)
    source = llama_config(model) if isinstance(model, ModelShape) else model
    policy = load_causal_lm(source, dtype=dtype, trust_remote_code=trust_remote_code)
    policy.to(device)
    reference = copy.deepcopy(policy).eval()
    reference.requires_grad_(False)
    policy.train()
    prepare_model(policy, backend)
    prepare_model(reference, backend)
    return policy, reference, ModelShape.from_config(policy.config)

