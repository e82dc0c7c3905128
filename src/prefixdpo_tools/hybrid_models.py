"""Tiny random hybrid models (recurrent or convolution layers beside attention, or attention sinks): one builder
for the tests, `verify`'s examples, `bench`'s hybrid profile and `make gpu-check`'s hybrid section.

Each family is the transformers architecture named by its `model_type`, shrunk to hidden 64 with four layers that
hold every layer type the family has (e.g. Gated DeltaNet and full attention for Qwen3.5), at vocab 96 (the embedded
tokenizer's). Weights are drawn at std 0.2 so a wrong layout shows in the log-probs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the models are built
    import torch

_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)  # ids inside the tiny vocab

_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1,
               mamba_chunk_size=8)

# model_type -> the config fields that make it tiny and give it each of its layer types
HYBRID_FAMILIES: dict[str, dict] = {
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                         linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                       linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                             linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
                 block_auto_adjust_ff_dim=False, block_multiple_of=16),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1),
    "lfm3": dict(layer_types=["conv", "full_attention", "conv", "sliding_attention"], conv_L_cache=4,
                 sliding_window=64),
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "mlp", "moe"], mamba_num_heads=4, mamba_head_dim=16,
                       n_groups=1, ssm_state_size=16, conv_kernel=4, expand=1, chunk_size=8, n_routed_experts=4,
                       n_shared_experts=1, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                       num_experts_per_tok=2),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=4,
                             num_experts_per_tok=2, shared_intermediate_size=64, **_MAMBA2),
    "falcon_h1": dict(mamba_d_ssm=64, **_MAMBA2),
    "bamba": dict(attn_layer_indices=[1, 3], **_MAMBA2),
    "kimi_linear": dict(linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                                            "head_dim": 16, "short_conv_kernel_size": 4},
                        num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1,
                        first_k_dense_replace=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, mla_use_nope=True,
                        # MLA expands its keys to every head, as Kimi Linear's own configs say (kv heads = heads):
                        # with fewer, transformers' SDPA path under any mask repeats the expanded keys again
                        num_key_value_heads=4),
    # a pure Mamba2 model (no attention layer), and Zamba2 (Mamba2 layers, a shared attention block between them)
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1, state_size=16, conv_kernel=4, expand=1, chunk_size=8),
    "zamba2": dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=4, mamba_ngroups=1,
                   mamba_d_state=16, mamba_d_conv=4, mamba_expand=1, chunk_size=8, num_mem_blocks=1, use_mem_rope=True),
    # Jamba's Mamba (1) mixer: its scan takes no initial state (`core.recurrent.UNSUPPORTED_MIXERS`): the family
    # prefix sharing refuses and `--prefix_sharing false` trains
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=4, expert_layer_offset=3,
                  num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
                  mamba_dt_rank=8),
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    sliding_window=16, num_local_experts=4, num_experts_per_tok=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
}


def tiny_hybrid_lm(family: str, dtype: "torch.dtype | None" = None, device: str = "cpu", seed: int = 0,
                   std: float = 0.2, **overrides):
    """A tiny random model of `family` (a key of HYBRID_FAMILIES; `overrides`: config fields) in eval mode, its weight
    matrices at `std`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**_COMMON, **HYBRID_FAMILIES[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model.to(device=device, dtype=dtype or torch.float32).train(False)


def _tiled(value, layers: int):
    """A per-layer list tiled (or cut) to `layers` entries."""
    return [value[i % len(value)] for i in range(layers)]


def hybrid_config(family: str, *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                  head_dim: int, vocab: int, max_positions: int = 16384):
    """The config of a random `family` model at a benchmark's dimensions (`bench --architecture`): the family's
    layer pattern of `HYBRID_FAMILIES` tiled to `layers`, its recurrent layers at the attention's heads and head_dim."""
    from transformers import AutoConfig

    fields = dict(HYBRID_FAMILIES[family])
    for key in ("layer_types", "layers_block_type"):
        if key in fields:
            fields[key] = _tiled(fields[key], layers)
    if "attn_layer_indices" in fields:
        fields["attn_layer_indices"] = list(range(1, layers, 2))
    if "linear_attn_config" in fields:
        fields["linear_attn_config"] = {**fields["linear_attn_config"], "num_heads": heads, "head_dim": head_dim,
                                        "kda_layers": list(range(1, layers + 1, 2)),
                                        "full_attn_layers": list(range(2, layers + 1, 2))}
    for key, value in (("linear_num_value_heads", heads), ("linear_num_key_heads", kv_heads),
                       ("linear_key_head_dim", head_dim), ("linear_value_head_dim", head_dim),
                       ("mamba_n_heads", heads), ("mamba_num_heads", heads), ("mamba_d_head", head_dim),
                       ("mamba_head_dim", head_dim), ("mamba_d_ssm", heads * head_dim)):
        if key in fields:
            fields[key] = value
    common = {**_COMMON, "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "max_position_embeddings": max_positions}
    if "num_key_value_heads" in fields:  # Kimi Linear's MLA expands its keys to every head
        fields["num_key_value_heads"] = heads
    return AutoConfig.for_model(family, **{**common, **fields})
