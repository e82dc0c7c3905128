"""Attention with sinks (gpt-oss) on prefix-shared lines, on the CPU's dense-mask and segmented backends.

A sink is a learned logit per head that joins every query's softmax and is then dropped: each query's weights sum to
less than one. torch's SDPA has no such term, so the sdpa backend runs the model's OWN eager attention (the
`eager_attention_forward` of the module's modeling file, which transformers runs for gpt-oss, whose flag says it has no
SDPA) over the line's rule as an additive mask: the same matmuls, the same sink concatenation, the same softmax, only
the mask is the prefix-sharing rule (and its sliding window, `masks.dense_mask`) instead of the causal one. A query
attends its ancestors and itself, so no row of the mask is empty. The segmented backend runs the same eager attention
per group of segments over the group's additive mask (`segments.segmented_attention`'s `attend`). The flex backend
(CUDA) has sinks of its own
(transformers' `flex_attention_forward` renormalises by the log-sum-exp with `s_aux`).
"""

from __future__ import annotations

import sys

import torch

SINK_KEYWORDS = ("s_aux", "sinks")  # the keyword a model's attention hands its sink logits over by


def has_sinks(kwargs: dict) -> bool:
    """Whether an attention call's keywords carry sink logits."""
    return any(kwargs.get(name) is not None for name in SINK_KEYWORDS)


def own_eager_attention(module):
    """The `eager_attention_forward` of the modeling file `module` (an attention layer) comes from, or None."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def model_has_sinks(model) -> bool:
    """Whether any attention layer of `model` holds sink logits (a `sinks` parameter, as gpt-oss's) that its own eager
    attention applies: the layers `sink_attention` runs."""
    return any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) and own_eager_attention(m) is not None
               for m in model.modules())


def sink_attention(module, query, key, value, additive_mask: torch.Tensor, **kwargs):
    """query [B, H, Lq, D], key/value [B, Hkv, Lk, D], additive_mask [B, 1, Lq, Lk] in query's dtype (0: may attend,
    the dtype's min: may not; `pass_plan.plan_mask`, built once a pass) -> ([B, Lq, H, D], weights): the module's own
    eager attention (module docstring) over it."""
    eager = own_eager_attention(module)
    if eager is None:
        raise ValueError(f"{type(module).__name__} hands sink logits to its attention but its modeling file has no "
                         "eager attention prefixdpo could run them with: use --attention flex (CUDA)")
    dropout = kwargs.pop("dropout", 0.0)
    return eager(module, query, key, value, additive_mask, dropout=dropout if module.training else 0.0, **kwargs)
