"""The policy and reference made ready for prefixdpo training: loaded if named, wrapped with PEFT, dropout
off (as TRL's `disable_dropout`), and switched to prefixdpo's attention (`model_checks.prepare_model`), or, with
prefix sharing off and a model that attention cannot run, kept on its own (`core.stock_attention`)."""

from __future__ import annotations

import logging

import torch

from prefixdpo.errors import ConfigError, UserError
from prefixdpo.core.model_checks import (
    backend_for_model, base_model, check_recurrent_options, prepare_model, refusal, unshareable_layers, unwrap,
)
from prefixdpo.core.stock_attention import STOCK, stock_implementation


def is_peft_model(model) -> bool:
    """Whether `model` (or the model an engine wraps) is a `peft.PeftModel`."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(unwrap(model), PeftModel)


def disable_dropout(model) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _load(name: str, args, dtype="float32"):
    # TRL's DPOTrainer loads a named model in float32 unless `model_init_kwargs` says otherwise (bf16 is then
    # autocast, with fp32 master weights); `model_init_kwargs` win over everything else.
    from prefixdpo.core.models import load_causal_lm

    return load_causal_lm(name, dtype=dtype, trust_remote_code=args.trust_remote_code,
                          model_init_kwargs=args.model_init_kwargs)


def prepare_policy(model, args, *, backend: str, peft_config=None, tokenizer=None):
    """(model, tokenizer, the pass backend of the run) ready to train; `model` may be a name/path (its tokenizer is
    loaded too). The pass backend is `backend`, or `STOCK` where prefix sharing is off and prefixdpo's attention
    cannot run the model (`model_checks.prepare_model`; its options checked by `check_stock_route`)."""
    if isinstance(model, str):
        from prefixdpo.core.models import load_tokenizer

        tokenizer = tokenizer or load_tokenizer(model, trust_remote_code=args.trust_remote_code,
                                                revision=(args.model_init_kwargs or {}).get("revision"))
        model = _load(model, args)
    if model is None:
        raise UserError("PrefixDPOTrainer needs a model (a model object or a name/path)")
    if peft_config is not None:
        if is_peft_model(model):
            raise UserError("model is already a PEFT model; do not pass peft_config as well")
        from peft import get_peft_model

        if args.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):  # both names agree here
            model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
        quantized = is_quantized(model)
        try:
            model = get_peft_model(model, peft_config)
        except ValueError as err:  # PEFT's words for a config that does not fit the model (targets not found, ...)
            raise ConfigError(f"the LoRA config does not fit {type(model).__name__}: "
                              f"{' '.join(str(err).split())}") from None
        if quantized:
            adapters_to_bf16(model)
    if args.disable_dropout:
        disable_dropout(model)
    backend = backend_for_model(model, backend, getattr(args, "attention", backend))
    run_backend = prepare_model(model, backend, prefix_sharing=args.prefix_sharing)
    if run_backend == STOCK:
        check_stock_route(model, args, backend)
    else:
        check_recurrent_options(model, sequence_parallel_size=getattr(args, "sequence_parallel_size", 1))
    return model, tokenizer, run_backend


def check_stock_route(model, args, backend: str) -> None:
    """One-line ConfigErrors for the options the `STOCK` route (the model's own attention on padded rows) cannot
    run, and a log line saying the route is taken and why. backend: the one prefixdpo's attention would have run."""
    base = base_model(model)
    name, reason = type(base).__name__, refusal(model, backend)
    if args.packing:
        # the model's own attention and its recurrent layers see a packed line as one sequence
        raise ConfigError(f"packing=true cannot run {name} with prefix sharing off: its own attention and layers would "
                          "run one packed sequence into the next (prefixdpo's attention, which keeps them apart, "
                          "cannot run it); set --packing false")
    if getattr(args, "sequence_parallel_size", 1) > 1:
        raise ConfigError(f"sequence_parallel_size > 1 needs prefixdpo's attention, which cannot run {name}; set "
                          "--sequence_parallel_size 1")
    logging.getLogger(__name__).info(
        "prefix sharing off: %s runs its own attention (%s) on padded rows, as TRL's trainers run it (%s)", name,
        stock_implementation(base), reason)


def is_quantized(model) -> bool:
    """Whether bitsandbytes loaded `model` in 4 or 8 bit (only quantized models carry these attributes)."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def adapters_to_bf16(model) -> None:
    """QLoRA, as TRL's trainers do: the trainable adapter weights of a quantized model in bf16 (the QLoRA paper's
    recommendation), except DoRA's magnitude vectors, whose small updates bf16 would round away."""
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)


def ignore_bool_buffers_in_ddp(model) -> list[str]:
    """TRL's `ignore_bias_buffers`: name every boolean buffer of `model` in `_ddp_params_and_buffers_to_ignore`,
    which DDP reads when it wraps the model, so it neither broadcasts nor syncs them. Returns the names."""
    names = [name for name, buffer in model.named_buffers() if buffer.dtype == torch.bool]
    model._ddp_params_and_buffers_to_ignore = names
    return names


def prepare_reference(ref_model, args, *, backend: str, policy_dtype=torch.float32):
    """A separate reference model (or name/path, loaded in the policy's dtype as TRL does) ready for no-grad
    passes with the policy's mask; None stays None. Called by `dpo.reference.build_reference`, which decides
    what the reference is."""
    if ref_model is None:
        return None
    if isinstance(ref_model, str):
        ref_model = _load(ref_model, args, dtype=policy_dtype)
    if prepare_model(ref_model, backend, prefix_sharing=args.prefix_sharing) != backend:  # its passes: the policy's
        layers = unshareable_layers(ref_model)
        why = f"its layers of type {layers}" if layers else refusal(ref_model, backend)
        raise ConfigError(f"ref_model {type(base_model(ref_model)).__name__} cannot run the policy's passes, which run "
                          f"prefixdpo's attention (attention={backend}): {why}; use a reference of the policy's "
                          "architecture, or none (a frozen copy of the policy)")
    if args.disable_dropout:
        disable_dropout(ref_model)
    return ref_model
