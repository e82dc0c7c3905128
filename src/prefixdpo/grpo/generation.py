"""Shared-prompt generation: TRL's transformers `generate` of a group batch with each unique prompt prefilled once.

TRL 1.16's `RepeatSampler` gives each prompt G rows, and its transformers path (`use_vllm` false) left-pads all N
rows and calls `generate` on them: every prompt is prefilled G times. Here the N rows are grouped by their prompt
row (token ids *and* padding, so identical rows only: what TRL's copies of one prompt are), and:

1. the U unique rows' first P - 1 columns run one no-grad forward into a `DynamicCache` (the prompt's KV computed
   once: U x (P - 1) tokens instead of N x P);
2. the cache is expanded to the N rows by index (`cache_rows`: transformers' own `batch_select_indices`, or, for a
   hybrid's recurrent layers, `reorder_cache`: row i gets its prompt's keys and values, or its conv and recurrent
   states, with the layer's flags that a previous state exists);
3. transformers' own `generate` then runs on TRL's N rows with that cache: it computes only the uncached column
   (each row's last prompt token) and the new tokens, with TRL's `GenerationConfig` untouched (sampling,
   temperature, top-p/k, min-p, repetition penalty over the full prompt ids, EOS and padding of finished rows).

The same seed gives the same completions as TRL's: the prefill draws no random numbers (it runs only where no
dropout is active), and `generate` draws exactly what it draws for TRL (one `multinomial` of [N, vocab] per step).
Logits equal TRL's to fp32 rounding (a batch of U rows and one of N rows may round differently), so a sampled token
can differ only where the draw falls within rounding of a boundary between two tokens' probabilities.

What it saves: the prefill's compute and its transient activations (U instead of N prompt rows through the model);
and, where the model runs prefixdpo's attention (a GRPO/RLOO policy does), decoding's too: the cache holds each
prompt's keys and values once (`core.attention.shared_prompt.SharedPromptLayer`: U copies instead of N, and no
re-concatenation of the prompt columns at each step), and each step attends to the prompt part as one matmul per
prompt with its G rows' queries side by side, merged with each row's own columns by their log-sum-exps (cascade /
Hydragen attention; exact up to rounding). Elsewhere (stock attention, sliding-window layers) the cache is
expanded to N copies by index, as TRL's holds.

Hybrids (Gated DeltaNet, short convolutions, Mamba2 beside attention: transformers' `LinearAttentionLayer` and
Falcon-H1's `LinearAttentionAndFullAttentionLayer` caches) share the prefill: each row gets its own copy of its
prompt's recurrent states (they diverge at the first new token, so the saving is the prefill's compute, not the
states' memory), and the last prompt column then runs through the mixers' one-column decode path (conv update,
recurrent step) where TRL's runs it inside the chunked prefill: the same math, logits equal to rounding
(tests/test_hybrid_generation.py). Their attention layers hold prompts once as above, except Falcon-H1's (attention
and Mamba2 state in one layer object) and MLA's (Kimi Linear: the cache holds latents), which get a copy per row.

Where this cannot be exact it is not used, and the reason is returned (`why_not_shared`): a model or cache whose
state is neither per-token keys and values nor a linear-attention layer's (quantized, static or indexed caches), a
recurrent mixer that keeps its state outside the cache or reads the whole padding mask at a one-column step
(`cache_rows.unshared_mixers`: Mamba's and FalconMamba's mixers, RecurrentGemma's, ones not tested yet), right
padding on a hybrid or padding in its one-column prefill (2-column prompts: transformers masks no recurrent layer's
one-column call), a prompt longer than a sliding window, beam search or assisted decoding, inputs besides token
ids (images), a forward that draws random numbers (dropout or MoE router jitter in training mode).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation import GenerationMode

from prefixdpo.core.attention.backends import ATTENTION_NAME
from prefixdpo.core.attention.pass_plan import decoding_plan
from prefixdpo.core.attention.shared_prompt import SharedPromptLayer
from prefixdpo.core.model_checks import base_model, text_config
from prefixdpo.grpo.cache_rows import expand_layer, has_recurrent_state, unexpandable_layers, unshared_mixers

# Decoding modes whose steps read nothing but the cache and the ids so far.
_SHARED_MODES = (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH)
# `generate` inputs the prefix prefill reproduces; anything else (pixel values, token type ids) is TRL's path.
_TEXT_INPUTS = frozenset({"input_ids", "attention_mask"})


@dataclass(frozen=True)
class PromptGroups:
    """The unique prompt rows of a generate batch.

    input_ids, attention_mask: [U, P] the unique rows (TRL's left padding kept); row_to_unique: [N] long.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    row_to_unique: torch.Tensor

    @property
    def num_unique(self) -> int:
        return int(self.input_ids.shape[0])


def group_prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PromptGroups:
    """Group the rows [N, P] by equal (ids, mask): TRL's G copies of a prompt are equal rows, and only equal rows
    may share a cache (a different padding puts the same tokens at other columns)."""
    P = input_ids.shape[1]
    keys = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
    return PromptGroups(unique[:, :P], unique[:, P:].to(attention_mask.dtype), inverse)


def cache_kwarg(model) -> str | None:
    """The name the model's forward takes its KV cache by (transformers renamed `past_key_values` to `cache`)."""
    params = inspect.signature(base_model(model).forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


# config fields of random draws a forward makes in training mode besides `nn.Dropout` modules
_RANDOM_IN_TRAINING = ("attention_dropout", "attn_pdrop", "router_jitter_noise")


def _draws_random_numbers(model) -> bool:
    """Whether a forward of `model` draws random numbers (dropout, MoE router jitter, in training mode): the
    prefill's different batch shape would then draw differently from TRL's and change every later sample."""
    if not model.training:
        return False
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in model.modules()):
        return True
    cfg = text_config(base_model(model))
    return any(float(getattr(cfg, name, 0.0) or 0.0) > 0 for name in _RANDOM_IN_TRAINING)


def why_not_shared(model, generation_config, inputs: dict) -> str | None:
    """Why this generate call must run as TRL runs it (None: the shared prefill reproduces it)."""
    base = base_model(model)
    extra = sorted(k for k, v in inputs.items() if k not in _TEXT_INPUTS and v is not None)
    if extra:
        return f"generate receives {', '.join(extra)} besides token ids"
    if "input_ids" not in inputs or inputs.get("attention_mask") is None:
        return "generate receives no token ids with an attention mask"
    if getattr(text_config(base), "is_encoder_decoder", False):
        return f"{type(base).__name__} is an encoder-decoder model"
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return "a PEFT prompt-learning adapter adds virtual tokens to the cache"
    mode = generation_config.get_generation_mode()
    if mode not in _SHARED_MODES:
        return f"the generation mode is {mode.value} (shared only for sampling and greedy decoding)"
    if generation_config.use_cache is False:
        return "the generation config turns the KV cache off"
    if generation_config.cache_implementation is not None:
        return (f"cache_implementation={generation_config.cache_implementation!r} builds its own cache "
                "(transformers takes no pre-filled cache with it)")
    if generation_config.prefill_chunk_size is not None:
        return "the generation config prefills in chunks"
    if not base._supports_default_dynamic_cache() or cache_kwarg(model) is None:
        return f"{type(base).__name__} does not take a DynamicCache"
    layers = DynamicCache(config=text_config(base)).layers
    kinds = unexpandable_layers(layers)
    if kinds:
        return (f"{type(base).__name__}'s cache holds {', '.join(kinds)} (neither per-token keys and values nor a "
                "linear-attention state)")
    window = min((layer.sliding_window for layer in layers if isinstance(layer, DynamicSlidingWindowLayer)),
                 default=None)
    if window is not None and inputs["input_ids"].shape[1] > window:
        return f"prompts of {inputs['input_ids'].shape[1]} columns exceed the sliding window of {window}"
    if inputs["input_ids"].shape[1] < 2:
        return "the prompts are one column wide (nothing before the last token to prefill)"
    reason = _why_not_shared_recurrent(base, layers, inputs["attention_mask"])
    if reason is not None:
        return reason
    if _draws_random_numbers(model):
        return ("the model draws random numbers in its forward during generation (dropout or router jitter in "
                "training mode), which depend on the batch shape")
    return None


def _why_not_shared_recurrent(base, layers, attention_mask: torch.Tensor) -> str | None:
    """Why the prompts' recurrent states cannot be prefilled once (None: they can, or there are none; `cache_rows`)."""
    mixers = unshared_mixers(base, layers)
    if mixers:
        name, why = next(iter(mixers.items()))
        return f"{type(base).__name__}'s {name}: {why}" if name else f"{type(base).__name__}: {why}"
    if not has_recurrent_state(layers):
        return None
    # a recurrent layer zeroes padding by the 2D mask only in a call of two or more columns
    # (`create_recurrent_attention_mask`): the last column decodes alone, and so would a one-column prefill
    if not bool(attention_mask[:, -1].all()):
        return f"{type(base).__name__} has recurrent layers and a prompt's last column is padding (right padding)"
    if attention_mask.shape[1] == 2 and not bool(attention_mask[:, 0].all()):
        return (f"{type(base).__name__} has recurrent layers and the one-column prefill of 2-column prompts holds "
                "padding (a one-column call is not masked)")
    return None


@dataclass
class PrefillCount:
    """Prompt tokens prefilled: what TRL's generate would (every real prompt token of every row) and what ran. The
    same for a hybrid: its recurrent layers run the tokens its attention layers run."""

    trl_tokens: int = 0
    ran_tokens: int = 0

    def add(self, groups: PromptGroups, attention_mask: torch.Tensor) -> None:
        self.trl_tokens += int(attention_mask.sum())
        # the unique rows' first P - 1 columns, then every row's last column inside generate
        self.ran_tokens += int(groups.attention_mask[:, :-1].sum()) + int(attention_mask.shape[0])


def prefill_shared_prompts(model, groups: PromptGroups) -> DynamicCache:
    """Run the unique rows' first P - 1 columns through `model` (no grad) and return their cache for the N rows:
    per layer the U prompts' [U, heads, P - 1, head_dim] keys and values held once (`SharedPromptLayer`), or,
    where that cannot run (`why_not_shared_cache`), expanded to [N, heads, P - 1, head_dim] by index; a recurrent
    layer's conv and recurrent states [U, ...] expanded to [N, ...] by index (`cache_rows.expand_layer`).

    The inputs are those `generate` gives its own prefill (its `prepare_inputs_for_generation`): positions from the
    padding mask's running count (0 at padding), the mask dropped where no row is padded."""
    ids, mask = groups.input_ids[:, :-1], groups.attention_mask[:, :-1]
    base = base_model(model)
    cache = DynamicCache(config=text_config(base))
    params = inspect.signature(base.forward).parameters
    inputs = {"input_ids": ids, cache_kwarg(model): cache, "use_cache": True,
              "attention_mask": None if bool((mask == 1).all()) else mask}
    if "position_ids" in params:
        inputs["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    if "logits_to_keep" in params:
        inputs["logits_to_keep"] = 1  # the prefill's logits are not used; one position keeps the head cheap
    with torch.no_grad():
        model(**inputs)
    held_once = why_not_shared_cache(model, cache, groups) is None
    for i, layer in enumerate(cache.layers):
        if held_once and type(layer) is DynamicLayer:
            cache.layers[i] = SharedPromptLayer(layer.keys, layer.values, mask, groups.row_to_unique)
        else:  # keys and values, or a recurrent layer's states, a copy per row (`cache_rows`)
            expand_layer(layer, groups.row_to_unique)
    return cache


# Decoding over prompts held once pays ~15 small operations per layer and step for neither copying the prompts' keys
# and values N - U more times nor re-concatenating them at every step. Measured on 1 CPU core (100 new tokens, 2
# prompts x 8 rows, fp32, time with copies over time held once, two runs): the bench's quick model (1 KV head of 64)
# with prompts of 74 / 150 / 300 / 887 columns (copies of 0.5 / 1.0 / 2.1 / 6.3 MiB per layer) 0.82-1.01 / 0.94 /
# 1.28-1.35 / 1.67-2.27; its medium model (2 KV heads) at 300 columns (4.3 MiB) 1.18. Below 2 MiB, past the
# break-even, the copies are kept.
MIN_SHARED_PROMPT_BYTES = 2 << 20


def why_not_shared_cache(model, cache: DynamicCache, groups: PromptGroups) -> str | None:
    """Why decoding holds each row's own copy of its prompt's keys and values (None: one copy per prompt,
    `SharedPromptLayer`): only prefixdpo's attention reads a shared prompt; only plain per-token layers hold one (a
    sliding window would drop prompt columns as decoding moves on; a hybrid's recurrent layers and Falcon-H1's
    layers of both kinds get their copies); and copies smaller than
    `MIN_SHARED_PROMPT_BYTES` per layer cost less than the merge's extra operations."""
    if getattr(base_model(model).config, "_attn_implementation", None) != ATTENTION_NAME:
        return "the model does not run prefixdpo's attention"
    if any(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers):
        return "the cache has sliding-window layers"
    if getattr(text_config(base_model(model)), "kv_lora_rank", None):
        # the attention expands them after the cache update: the keys it gets are not the cached ones
        return "the cache holds MLA's compressed latents, not the keys the attention reads"
    attention = [layer for layer in cache.layers if type(layer) is DynamicLayer]
    if not attention:  # e.g. Falcon-H1's layers hold attention and Mamba2 state in one object
        return "no layer of the cache holds keys and values alone"
    keys = attention[0].keys
    copies = 2 * (groups.row_to_unique.numel() - groups.num_unique) * keys[0].numel() * keys.element_size()
    if copies < MIN_SHARED_PROMPT_BYTES:
        return f"the prompts' copies would hold {copies} bytes per layer (< {MIN_SHARED_PROMPT_BYTES})"
    return None


def effective_generation_config(model, generation_config):
    """The config `generate` will decode with: the one passed, its unset fields from the model's own generation
    config (transformers' merge), so a beam count set only on the model is seen."""
    base = base_model(model)
    try:
        return base._prepare_generation_config(generation_config)[0]
    except (AttributeError, TypeError, ValueError):  # a transformers without the merge, or one that refuses it
        return generation_config if generation_config is not None else base.generation_config


def shared_prompt_generate(model, generate, count: PrefillCount | None = None, /, **kwargs):
    """`generate(**kwargs)` of TRL's call (input_ids / attention_mask [N, P], generation_config) with each unique
    prompt row prefilled once (module doc); the caller has checked `why_not_shared`.

    It prefills even when no two rows are equal (a tool-call turn): every rank then runs the same number of forwards
    whatever its rows, as sharded engines (ZeRO-3, FSDP) need for their collectives."""
    input_ids, attention_mask = kwargs["input_ids"], kwargs["attention_mask"]
    groups = group_prompt_rows(input_ids, attention_mask)
    cache = prefill_shared_prompts(model, groups)
    if count is not None:
        count.add(groups, attention_mask)
    shared = any(isinstance(layer, SharedPromptLayer) for layer in cache.layers)
    plan = decoding_plan(cache, int(input_ids.shape[0]), input_ids.device) if shared else None
    with forward_with_plan(base_model(model), plan):
        out = generate(**kwargs, **{cache_kwarg(model): cache})
    for layer in cache.layers:  # the last step's keys too
        if isinstance(layer, SharedPromptLayer):
            layer.check_read()
    return out


@contextlib.contextmanager
def forward_with_plan(hf, plan):
    """While inside: every call of `hf` (the transformers model `generate` runs) gets `pass_plan=plan`, which its
    attention calls receive (`backends.prefix_attention_forward`); None: unchanged. `generate` checks its keywords
    against the forward's signature, which the wrapper keeps (`functools.wraps`), so the plan is added here, not
    passed to `generate`."""
    if plan is None:
        yield
        return
    own = hf.__dict__.get("forward")  # an instance-level forward (accelerate's autocast wrapper) stays in use
    inner = own if own is not None else hf.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return inner(*args, **kwargs, pass_plan=plan)

    hf.forward = forward
    try:
        yield
    finally:
        if own is not None:
            hf.forward = own
        else:
            del hf.forward


class SharedPromptRoute:
    """What `model.generate` does while routed (`generate_routed`): shared-prompt generation where it is exact,
    else the original call, with the reason handed to `note` (the trainer logs it once)."""

    def __init__(self, note):
        self.note = note
        self.count = PrefillCount()

    def __call__(self, model, generate, **kwargs):
        config = effective_generation_config(model, kwargs.get("generation_config"))
        reason = why_not_shared(model, config, {k: v for k, v in kwargs.items() if k != "generation_config"})
        if reason is not None:
            self.note(reason)
            return generate(**kwargs)
        return shared_prompt_generate(model, generate, self.count, **kwargs)


@contextlib.contextmanager
def generate_routed(model, route):
    """While inside: `model.generate(**kwargs)` calls `route(model, original_generate, **kwargs)`; the instance's
    own attribute is removed after (the class's method shows again)."""
    original = model.generate
    had_own = "generate" in vars(model)

    def routed(*args, **kwargs):
        if args:  # TRL passes keywords only; anything else is not the call this routes
            return original(*args, **kwargs)
        return route(model, original, **kwargs)

    model.generate = routed
    try:
        yield
    finally:
        if had_own:
            model.generate = original
        else:
            del model.generate
