"""Run any Hugging Face causal LM on prefix-shared lines and return per-response log-probs.

Everything runs inside the forward of the module the engine wraps (`through_engine`): the model's own
forward, a forward hook on its decoder that captures the final hidden states, and the LM head applied
only where a response token is predicted (`logprobs.py`). So DDP, FSDP2 (parameters unsharded only
between its pre- and post-forward hooks), DeepSpeed ZeRO-3 (parameters gathered per module call),
PEFT and gradient checkpointing all see one normal call, and the head's weight is the full one.
`logits_to_keep=1` keeps the model's own head to one position per line; that position doubles as a
check that our head path equals the model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Callable

import torch

from prefixdpo.attention.backends import ATTENTION_NAME, build_attention_mask, resolve_backend
from prefixdpo.data.batch import Batch
from prefixdpo.logprobs import ResponseLogps, UnsupportedModelError, check_head, lm_head_fn, response_logps
from prefixdpo.vml_warmup import warm_up as _warm_up_vml

_warm_up_vml()  # before this process's first forward: see prefixdpo.vml_warmup

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


def through_engine(model, body: Callable[..., dict], **inputs) -> dict:
    """Call `model` (bare, or wrapped by DDP / FSDP2 / DeepSpeed) with `inputs`, running `body` as the
    forward of the module the engine wraps: ``body(inner_forward, **inputs)``, where `inner_forward` is
    that module's own forward (accelerate's mixed-precision wrapper included, if any).

    body returns a dict of tensors: the engines find a forward's output tensors by walking dicts (DDP's
    unused-parameter search, FSDP2's pre-backward hooks), not arbitrary objects.
    """
    inner = unwrap(model)
    own = inner.__dict__.get("forward")  # an instance-level forward (accelerate's autocast wrapper) stays in use
    inner_forward = own if own is not None else inner.forward

    def forward(*args, **kwargs):
        if args:
            raise TypeError("prefixdpo passes every model input by keyword")
        return body(inner_forward, **kwargs)

    inner.forward = forward
    try:
        return model(**inputs)
    finally:
        if own is not None:
            inner.forward = own
        else:
            del inner.forward


def decoder_output(model, inner_forward, **inputs):
    """Run `inner_forward` (the forward of `unwrap(model)`, inside `through_engine`) with `inputs` and no KV
    cache; return (the decoder's final hidden states [B, L, D], captured by a hook, and the model's output)."""
    captured: list[torch.Tensor] = []

    def grab(_module, _inputs, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = unwrap(model).get_decoder().register_forward_hook(grab)
    try:
        out = inner_forward(use_cache=False, **inputs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise UnsupportedModelError(f"expected the decoder to run once, it ran {len(captured)} times")
    return captured[0], out


def final_hidden_states(model, inner_forward, **inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A causal LM's (hidden [B, L, D], its own logits at the last position [B, V] or None), inside
    `through_engine`."""
    # A MoE model asked for router logits computes its aux loss from `attention_mask` read as a [B, L]
    # padding mask, which ours is not: `recording_router_logits` collects them instead.
    moe = {"output_router_logits": False} if hasattr(text_config(unwrap(model)), "output_router_logits") else {}
    # logits_to_keep=1: the model's own head on one position only; we apply ours where needed
    hidden, out = decoder_output(model, inner_forward, logits_to_keep=1, **inputs, **moe)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return hidden, (logits[:, -1] if logits is not None and logits.dim() == 3 else None)


def _batch_inputs(batch: Batch, attention_mask) -> dict:
    return {"input_ids": batch.input_ids, "attention_mask": attention_mask, "position_ids": batch.position_ids}


def resolve_router_aux_loss_coef(model, coef: float | None) -> float:
    """TRL 1.16's MoE load-balancing coefficient: `coef`, or the model's own `router_aux_loss_coef` when
    None (0.0 if it declares none); 0.0 for a model that returns no router logits. A coefficient set
    for such a model is refused, as TRL refuses it."""
    hf = unwrap(model)
    cfg = text_config(base_model(model))
    moe = hasattr(cfg, "output_router_logits")
    if coef and not moe:
        raise UnsupportedModelError(
            f"router_aux_loss_coef is set to {coef} but {type(hf).__name__} is not a Mixture-of-Experts model "
            "that returns its router logits, so there is no auxiliary loss to weight"
        )
    if not moe:
        return 0.0
    return float(getattr(cfg, "router_aux_loss_coef", 0.0) if coef is None else coef)


@contextlib.contextmanager
def recording_router_logits(model):
    """Collect each MoE layer's router logits `[tokens, experts]` during a forward, into the yielded list.

    Hooks on the router modules transformers itself records `router_logits` from (the decoder's
    `_can_record_outputs`): asking the model for `output_router_logits` instead would make it compute its
    aux loss with our 4D attention mask, which `load_balancing_loss_func` reads as a `[B, L]` padding mask.
    """
    hf = unwrap(model)
    decoder = hf.get_decoder()
    recorder = (getattr(decoder, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    index = getattr(recorder, "index", 0)
    if not isinstance(target, type):
        raise UnsupportedModelError(f"{type(hf).__name__} does not expose its MoE router logits to transformers")
    captured: list[torch.Tensor] = []

    def grab(_module, _inputs, output):
        captured.append(output[index] if isinstance(output, (tuple, list)) else output)

    handles = [m.register_forward_hook(grab) for m in decoder.modules() if isinstance(m, target)]
    if not handles:
        raise UnsupportedModelError(f"{type(hf).__name__} has no {target.__name__} router modules")
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def trl_token_multiplicity(batch: Batch) -> torch.Tensor:
    """How many times TRL 1.16's paired rows hold each token of `batch`. -> [B, L] fp32 (0 = padding).

    TRL runs each pair as `[prompt][better]` and `[prompt][worse]`: a prompt token counts twice per pair
    of its example, a response token once per pair it is in. With these weights, the load-balancing loss
    of a prefix-shared row equals TRL's on its padded rows: a prompt's router logits are the same in
    both of TRL's rows (causal), and each response's are those of its separate sequence (the mask rule).
    Every response has at least one token (the layout refuses empty responses).
    """
    B, L = batch.input_ids.shape
    R, device = batch.num_responses, batch.input_ids.device
    docs = int(batch.doc_ids.max()) + 1 if batch.doc_ids.numel() else 1
    T = batch.target_response.numel()
    first = torch.full((R,), T, dtype=torch.long, device=device).scatter_reduce(
        0, batch.target_response, torch.arange(T, device=device), reduce="amin")  # first target of each response
    line = batch.target_line[first]
    example = line * docs + batch.doc_ids[line, batch.target_col[first]]  # [R]: (line, document) of each response
    first_response = torch.full((B * docs,), R, dtype=torch.long, device=device).scatter_reduce(
        0, example, torch.arange(R, device=device), reduce="amin")
    branch = torch.arange(R, device=device) - first_response[example] + 1  # responses are numbered in order
    in_pairs = torch.bincount(torch.cat([batch.pair_better, batch.pair_worse]), minlength=R).float()
    pairs_of_example = torch.bincount(example[batch.pair_better], minlength=B * docs).float()
    table = torch.zeros(B * docs, int(batch.branch_ids.max()) + 1, device=device)
    table[:, 0] = 2 * pairs_of_example
    table[example, branch] = in_pairs
    real = batch.doc_ids >= 0
    rows = torch.arange(B, device=device)[:, None] * docs + batch.doc_ids.clamp(min=0)
    return torch.where(real, table[rows, batch.branch_ids.clamp(min=0)], 0.0)


def router_aux_loss(model, router_logits: list[torch.Tensor], batch: Batch) -> torch.Tensor:
    """TRL 1.16's MoE load-balancing loss (transformers' Mixtral `load_balancing_loss_func`, which TRL
    uses for every MoE family) over the tokens of TRL's padded rows of `batch`'s pairs. -> scalar."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf = unwrap(model)
    cfg = text_config(base_model(model))
    return load_balancing_loss_func(tuple(router_logits), cfg.num_experts, cfg.num_experts_per_tok,
                                    trl_token_multiplicity(batch))


def compute_response_logps(
    model, batch: Batch, *, backend: str = "auto", chunk_size: int = 1024, attention_mask=None,
    wpo: bool = False, router_aux: bool = False,
) -> ResponseLogps:
    """Per-response log-prob sums and token counts for `batch` (grad follows torch.is_grad_enabled()).

    attention_mask: a prebuilt mask for this batch (shared by policy and reference passes), else built here.
    wpo: also WPO's aligned log-prob sums (`ResponseLogps.wpo_sums`), from the same head pass.
    router_aux: also the MoE load-balancing loss of this pass (`ResponseLogps.aux_loss`, TRL's).
    """
    device = batch.input_ids.device
    backend = resolve_backend(backend, device, needs_grad=torch.is_grad_enabled())
    hf = unwrap(model)
    check_sequences_fit_window(model, batch)
    if attention_mask is None:
        attention_mask = build_attention_mask(batch.doc_ids, batch.branch_ids, backend)

    def body(inner_forward, **inputs) -> dict:
        with recording_router_logits(model) if router_aux else contextlib.nullcontext() as router_logits:
            hidden, model_last_logits = final_hidden_states(model, inner_forward, **inputs)
        head = lm_head_fn(hf)
        if model_last_logits is not None and not getattr(hf, "_prefixdpo_head_checked", False):
            check_head(head, hidden[:, -1], model_last_logits)
            hf._prefixdpo_head_checked = True
        result = response_logps(hidden, batch, head, chunk_size, wpo=wpo)
        if router_aux:
            result.aux_loss = router_aux_loss(model, router_logits, batch)
        if model_last_logits is not None and model_last_logits.requires_grad:
            # FSDP2 crashes in backward (SIGSEGV, torch 2.13 + gloo) when an output of a sharded module (here the
            # model's own head call) has no path to the loss: give it one, of exactly zero.
            nothing = model_last_logits.sum() * 0.0
            result.sums = result.sums + nothing
            result.per_token = result.per_token + nothing
        return {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if getattr(result, f.name) is not None}

    return ResponseLogps(**through_engine(model, body, **_batch_inputs(batch, attention_mask)))


def zero_weight_loss(model, batch: Batch, backend: str) -> torch.Tensor:
    """0 x a function of every parameter: an empty (rank-balancing) micro-batch still runs the model, so DDP's
    gradient sync and FSDP's collectives line up on every rank."""
    def body(inner_forward, **inputs) -> dict:
        hidden, model_last_logits = final_hidden_states(model, inner_forward, **inputs)
        # the model's own logits are a function of every parameter (and, under FSDP2, must reach the loss);
        # a model that returns none gets our head on its last position
        last = model_last_logits if model_last_logits is not None else lm_head_fn(unwrap(model))(hidden[:, -1])
        return {"loss": last.sum() * 0.0}

    mask = build_attention_mask(batch.doc_ids, batch.branch_ids, backend)
    return through_engine(model, body, **_batch_inputs(batch, mask))["loss"]
