"""What prefixdpo needs to know about a Hugging Face model before it runs it: the model inside engine and PEFT
wrappers, its text config, whether the prefix-sharing rule reproduces its layers (`unshareable_layers`, the one list
of the layer types it cannot yet; refused naming the feature where not), switching it to prefixdpo's attention or,
with prefix sharing off, keeping its own (`core.stock_attention`), and a saved config that loads without
prefixdpo."""

from __future__ import annotations

import functools
import inspect

import torch

from prefixdpo.core.attention.backends import ATTENTION_NAME, WINDOWED_BACKENDS
from prefixdpo.core.attention.sinks import model_has_sinks
from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.core.recurrent import (SUPPORTED_MIXERS, UNSUPPORTED_MIXERS, prepare_recurrent, supported_mixers,
                                      unsupported_mixers)
from prefixdpo.core.stock_attention import STOCK, on_stock_route, use_stock_attention
from prefixdpo.data.batch import Batch
from prefixdpo.errors import ConfigError

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


def check_sequences_fit_window(model, batch: Batch, backend: str) -> None:
    """Refuse a batch whose longest `[prompt][response]` sequence is longer than the model's sliding window on a
    `backend` that does not slide it over a shared row (varlen; sdpa's, flex's and segmented's masks slide it,
    `backends.WINDOWED_BACKENDS`; a model on its own attention, the `STOCK` route, slides exactly: nothing to check)."""
    base = base_model(model)
    if on_stock_route(base) or backend in WINDOWED_BACKENDS:
        return
    window = sliding_window_of(base)
    if window is not None and batch.max_sequence_length > window:
        raise UnsupportedModelError(
            f"sliding-window attention (window {window}) is shorter than a sequence of "
            f"{batch.max_sequence_length} tokens in this batch; prefixdpo's {backend} attention would not reproduce "
            f"it (set max_length <= {window}, or use --attention sdpa or flex)"
        )


# The layer types the prefix-sharing rule reproduces: attention, whose mask is ours to give ...
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
# ... and blocks that mix nothing across tokens (NemotronH names its MLP and MoE blocks as layer types)
_PER_TOKEN_LAYER_TYPES = {"mlp", "moe"}


def _decoder_layers(base) -> list | None:
    """The decoder's layers in order (`model.layers` of a transformers decoder), or None where it has none."""
    try:
        layers = base.get_decoder().layers
    except AttributeError:
        return None
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else None


def _runs_its_states(module) -> bool:
    """Whether `module` holds a recurrent mixer `core.recurrent` runs from a parent's state."""
    return any(type(m).__name__ in SUPPORTED_MIXERS for m in module.modules())


def unshareable_layers(model) -> list[str]:
    """The layer types of `model` that prefixdpo cannot yet run on prefix-shared lines, sorted (empty: none).

    The one list of them: a recurrent mixer `core.recurrent` refuses by name (`unsupported_mixers`), and every layer
    type a config names (`layer_types`, or `layers_block_type` as NemotronH, Granite 4, Bamba, Falcon-H1) that is
    neither attention nor per-token, e.g. "linear_attention" (Gated DeltaNet, Kimi Delta Attention, and Mamba2 as
    transformers 5 names it), LFM2's "conv", Falcon-H1's "hybrid", unless that layer holds a mixer `core.recurrent`
    runs from its parent span's state (`SUPPORTED_MIXERS`): any other carries a convolution window or a recurrent state
    from one response straight into the next on a shared line, whatever the attention mask. A config that names no
    layer types gives such a layer away by a sequence convolution (`nn.Conv1d`): the class names of the modules that
    hold one (a supported mixer's excepted).
    """
    base = base_model(model)
    refused = unsupported_mixers(base)
    if refused:
        return sorted(refused)
    cfg = text_config(base)
    named = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None) or ()
    if named:
        layers = _decoder_layers(base)
        return sorted({kind for i, kind in enumerate(named)
                       if kind not in _ATTENTION_LAYER_TYPES | _PER_TOKEN_LAYER_TYPES
                       and not (layers is not None and i < len(layers) and _runs_its_states(layers[i]))})
    return sorted({type(module).__name__ for module in base.modules()
                   if type(module).__name__ not in SUPPORTED_MIXERS
                   and any(isinstance(child, torch.nn.Conv1d) for child in module.children())})


SHARING_OFF = "--prefix_sharing false"  # the option that trains such a model anyway, as TRL does


def unshareable_message(model) -> str:
    """The one line refusing prefix sharing for `model` (its `unshareable_layers`), with why for each mixer
    `core.recurrent` refuses by name (`unsupported_mixers`)."""
    base = base_model(model)
    name, layers, reasons = type(base).__name__, unshareable_layers(base), unsupported_mixers(base)
    why = "; ".join(f"{layer} {reasons[layer]}" for layer in layers if layer in reasons)
    return (f"{name} has layers of type {layers}, which carry a convolution or recurrent state along the sequence: "
            f"prefixdpo cannot reproduce them on prefix-shared lines{f' ({why})' if why else ' yet'}; train it without "
            f"prefix sharing ({SHARING_OFF}: TRL's padded rows on the model's own attention)")


def takes_position_ids(model) -> bool:
    """Whether `model`'s forward names `position_ids` (a pure state-space model, e.g. Mamba2, has no positions). Its
    class's forward: during a pass the instance's is `model_call.through_engine`'s (*args, **kwargs) stand-in."""
    return "position_ids" in _forward_parameters(type(base_model(model)))


@functools.lru_cache(maxsize=None)
def _forward_parameters(cls) -> frozenset[str]:
    """The parameter names of a model class's forward, read once per class (every pass asks)."""
    return frozenset(inspect.signature(cls.forward).parameters)


def has_attention(model) -> bool:
    """Whether `model` holds an attention module: a module whose class name ends in "Attention" (transformers' naming,
    LlamaAttention to GptOssAttention) that is not a recurrent mixer `core.recurrent` knows (Kimi Delta Attention,
    MiniMax's lightning attention, RWKV's)."""
    mixers = SUPPORTED_MIXERS.keys() | UNSUPPORTED_MIXERS.keys()
    return any(type(m).__name__.endswith("Attention") and type(m).__name__ not in mixers
               for m in base_model(model).modules())


def refusal(model, backend: str) -> str | None:
    """Why prefixdpo's attention on `backend` cannot reproduce `model` on prefix-shared lines (one line), or None.
    Every reason but an encoder-decoder's (`check_runs_unshared`) is one that prefix sharing off gets round by running
    the model's own attention on TRL's padded rows (`core.stock_attention`)."""
    base = base_model(model)
    cfg = text_config(base)
    name = type(base).__name__
    if unshareable_layers(base):
        return unshareable_message(base)
    if not has_attention(base):
        # a pure state-space model (Mamba2): nothing for the mask or positions to reproduce; its recurrent layers all
        # run from their parents' states (unshareable_layers found none they cannot)
        return None
    if not takes_position_ids(base):
        return (f"{name}.forward takes no position_ids, so a response cannot restart its positions after its prompt "
                f"on a shared line; train it with {SHARING_OFF}")
    # a hybrid whose recurrent mixers core.recurrent runs: its attention layers dispatch through AttentionInterface
    # (tests/test_recurrent_exact.py runs every such family exact on prefixdpo's attention), whatever its flag says
    if not getattr(base, "_supports_attention_backend", False) and not supported_mixers(base):
        return (f"{name} does not dispatch attention through transformers' AttentionInterface; prefixdpo cannot give "
                f"it the prefix-sharing mask (train it with {SHARING_OFF})")
    if getattr(cfg, "attn_logit_softcapping", None) is not None and backend != "flex":
        return (f"{name} uses attention logit soft-capping, which only the flex backend reproduces (CUDA); or train it "
                f"with {SHARING_OFF}")
    sinks = model_has_sinks(base)  # gpt-oss: the sdpa backend runs its own eager attention with them (`sinks`)
    if backend == "varlen" and sinks:
        return (f"{name} has attention sinks, which the {backend} backend does not run: use --attention sdpa (or flex "
                f"on CUDA), or train it with {SHARING_OFF}")
    if backend in ("sdpa", "segmented") and not getattr(base, "_supports_sdpa", False) and not sinks:
        return f"{name} does not support SDPA attention (attention={backend}); or train it with {SHARING_OFF}"
    if backend == "flex" and not getattr(base, "_supports_flex_attn", False):
        return (f"{name} does not support FlexAttention (attention=flex): use --attention sdpa, or train it with "
                f"{SHARING_OFF}")
    if getattr(cfg, "model_type", "") in _ALIBI_MODEL_TYPES or getattr(cfg, "alibi", False):
        return f"{name} uses ALiBi position bias, which ignores position ids; or train it with {SHARING_OFF}"
    return None


def check_runs_unshared(model) -> None:
    """Refuse a model no prefixdpo pass can run, even unshared: an encoder-decoder. (A forward without position_ids
    runs unshared as TRL runs it: it is handed none, `model_call.model_pass`.)"""
    base = base_model(model)
    if getattr(text_config(base), "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(base).__name__} is an encoder-decoder model; prefixdpo needs a "
                                    "decoder-only causal LM")


def backend_for_model(model, backend: str, requested: str) -> str:
    """The backend a run uses on `model`: `backend` (resolved from the `requested` option), except that `auto`'s flex
    becomes sdpa for a model that does not declare FlexAttention support (Qwen3.5, Falcon-H1, Kimi Linear): `auto`
    picks a backend the model runs, where an explicit `flex` is refused in one line."""
    if requested == "auto" and backend == "flex" and not getattr(base_model(model), "_supports_flex_attn", False):
        return "sdpa"
    return backend


def check_recurrent_options(model, *, sequence_parallel_size: int) -> None:
    """The one-line ConfigError for the option a hybrid's recurrent layers (`core.recurrent`) cannot run with on
    prefix-shared lines: sequence parallelism (each rank holds some columns of a line; a recurrence runs along all of
    them). Prefix reuse runs: its prefix's pass hands its final states to the chunks (`PrefixKV.states`)."""
    base = base_model(model)
    if not supported_mixers(base):
        return
    if sequence_parallel_size > 1:
        raise ConfigError(f"sequence_parallel_size > 1 cannot run {type(base).__name__}'s recurrent layers: a "
                          "recurrence runs along the whole line, which its ranks hold in pieces: set "
                          "--sequence_parallel_size 1")


def check_model_supported(model, backend: str) -> None:
    """Refuse, naming the feature, any model whose attention semantics the rule does not reproduce."""
    check_runs_unshared(model)
    reason = refusal(model, backend)
    if reason is not None:
        raise UnsupportedModelError(reason)


def prepare_model(model, backend: str = "sdpa", prefix_sharing: bool = True) -> str:
    """Make `model` ready for passes on `backend` and return the pass backend its runs use: prefixdpo's attention
    on `backend` (after checking it is supported), or, with `prefix_sharing` off and a model prefixdpo's attention
    cannot run (`refusal`), or where `backend` already is `STOCK`, the model's own attention (`STOCK`,
    `core.stock_attention`: TRL's passes)."""
    base = base_model(model)
    if backend == STOCK or (not prefix_sharing and refusal(model, backend) is not None):
        check_runs_unshared(model)
        use_stock_attention(base)
        return STOCK
    check_model_supported(model, backend)
    use_stock_attention(base, on=False)
    if getattr(base.config, "_attn_implementation", None) != ATTENTION_NAME:
        base.set_attn_implementation(ATTENTION_NAME)
    prepare_recurrent(base)  # a hybrid's recurrent mixers run each span from its parent's state (idempotent)
    return backend


def restore_stock_attention(folder: str, implementation: str = "sdpa") -> None:
    """Rewrite a saved config.json to say `implementation` (the model's stock attention: `stock_implementation`, eager
    for gpt-oss, which has no SDPA) where it says prefixdpo's attention.

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

        cfg.update(dict.fromkeys(keys, implementation))
        atomic_write_json(path, cfg, indent=2, sort_keys=True)  # a kill leaves the saved config or this one
