"""The policy and reference made ready for prefixdpo training: loaded if named, wrapped with PEFT, dropout
off (as TRL's `disable_dropout`), and switched to prefixdpo's attention (`model_checks.prepare_model`)."""

from __future__ import annotations

import torch

from prefixdpo.errors import ConfigError, UserError
from prefixdpo.core.model_checks import prepare_model, unwrap


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
    """(model, tokenizer) ready to train; `model` may be a name/path (its tokenizer is loaded too)."""
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
    prepare_model(model, backend)
    return model, tokenizer


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
    prepare_model(ref_model, backend)
    if args.disable_dropout:
        disable_dropout(ref_model)
    return ref_model
