"""What prefixdpo needs to know about a Hugging Face model before it runs it: the model inside engine and PEFT
wrappers, its text config, whether the prefix-sharing rule reproduces its attention (refused naming the
feature where not), switching it to prefixdpo's attention, and a saved config that loads without prefixdpo."""

from __future__ import annotations

import inspect

import torch

from prefixdpo.core.attention.backends import ATTENTION_NAME
from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.data.batch import Batch

_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
_ALIBI_MODEL_TYPES = {"bloom", "mpt", "falcon", "baichuan"}


def unwrap(model):
    """The Hugging Face model inside DDP/FSDP/accelerate wrappers (PEFT models are kept: they forward
    `get_decoder` and friends to the base model)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def base_model(model):
    """The transformers model under engine wrappers (`unwrap`) and PEFT (its base model)."""
    hf = unwrap(model)
    return hf.get_base_model() if hasattr(hf, "get_base_model") else hf


def text_config(model):
    """The config of the model's text decoder (a multimodal config's text part)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def sliding_window_of(model) -> int | None:
    """The attention window if any layer uses sliding-window attention, else None."""
    cfg = text_config(model)
    window = getattr(cfg, "sliding_window", None)
    if window is None or getattr(cfg, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def check_sequences_fit_window(model, batch: Batch) -> None:
    """Refuse a batch whose longest `[prompt][response]` sequence is longer than the model's sliding window:
    the rule does not reproduce attention that slides over a shared row."""
    window = sliding_window_of(base_model(model))
    if window is not None and batch.max_sequence_length > window:
        raise UnsupportedModelError(
            f"sliding-window attention (window {window}) is shorter than a sequence of "
            f"{batch.max_sequence_length} tokens in this batch; prefixdpo would not reproduce it "
            f"(set max_length <= {window})"
        )


def check_model_supported(model, backend: str) -> None:
    """Refuse, naming the feature, any model whose attention semantics the rule does not reproduce."""
    base = base_model(model)
    cfg = text_config(base)
    name = type(base).__name__
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; prefixdpo needs a decoder-only causal LM")
    if not getattr(base, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not dispatch attention through transformers' AttentionInterface; "
            "prefixdpo cannot give it the prefix-sharing mask"
        )
    if getattr(cfg, "attn_logit_softcapping", None) is not None and backend != "flex":
        raise UnsupportedModelError(
            f"{name} uses attention logit soft-capping, which only the flex backend reproduces (CUDA)"
        )
    if backend in ("sdpa", "segmented") and not getattr(base, "_supports_sdpa", False):
        raise UnsupportedModelError(f"{name} does not support SDPA attention")
    if backend == "flex" and not getattr(base, "_supports_flex_attn", False):
        raise UnsupportedModelError(f"{name} does not support FlexAttention")
    layer_types = set(getattr(cfg, "layer_types", None) or ())
    if layer_types - _SUPPORTED_LAYER_TYPES:
        raise UnsupportedModelError(
            f"{name} has layers of type {sorted(layer_types - _SUPPORTED_LAYER_TYPES)} (not plain attention), "
            "which ignore the attention mask"
        )
    if getattr(cfg, "model_type", "") in _ALIBI_MODEL_TYPES or getattr(cfg, "alibi", False):
        raise UnsupportedModelError(f"{name} uses ALiBi position bias, which ignores position ids")
    if "position_ids" not in inspect.signature(base.forward).parameters:
        raise UnsupportedModelError(f"{name}.forward takes no position_ids, so responses cannot restart positions")


def prepare_model(model, backend: str = "sdpa") -> None:
    """Switch the model to prefixdpo's attention implementation (after checking it is supported)."""
    check_model_supported(model, backend)
    base = base_model(model)
    if getattr(base.config, "_attn_implementation", None) != ATTENTION_NAME:
        base.set_attn_implementation(ATTENTION_NAME)


def restore_stock_attention(folder: str) -> None:
    """Rewrite a saved config.json to say `sdpa` where it says prefixdpo's attention.

    Our attention name exists only where prefixdpo is imported: the stock one lets
    `AutoModelForCausalLM.from_pretrained` load the saved model anywhere.
    """
    import json
    import os

    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    keys = [k for k in ("_attn_implementation", "attn_implementation", "_attn_implementation_internal")
            if cfg.get(k) == ATTENTION_NAME]
    if keys:
        from prefixdpo.atomic_io import atomic_write_json

        cfg.update(dict.fromkeys(keys, "sdpa"))
        atomic_write_json(path, cfg, indent=2, sort_keys=True)  # a kill leaves the saved config or this one
