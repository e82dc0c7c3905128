"""The model options of every prefixdpo training command: `ModelArguments`, TRL 1.16's `ModelConfig` field for
field (name, type, default, meaning; tests/test_trl_model_config.py walks TRL's fields), and what they become.

- `from_pretrained_kwargs`: the keyword arguments TRL's scripts load the model with (`model_revision`,
  `attn_implementation`, `dtype`, `trust_remote_code`, the config's `model_init_kwargs` winning), plus the
  quantization config and device map of a quantized load;
- `peft_config`: TRL's own `trl.get_peft_config(self)`: a `LoraConfig` exactly when `use_peft`, from the fields
  TRL reads (`lora_r`, `lora_alpha`, `lora_dropout`, `lora_target_modules`, `lora_target_parameters`,
  `lora_modules_to_save`, `lora_task_type`, `use_rslora`, `use_dora`);
- `quantization_config`: TRL's own `trl.get_quantization_config(self)` (`load_in_4bit` / `load_in_8bit`,
  `bnb_4bit_quant_type`, `use_bnb_nested_quant`, `bnb_4bit_quant_storage`, compute dtype `dtype`), refused in
  one line where this machine cannot load it (no CUDA device, no bitsandbytes).

A command subclasses `ModelArguments` for what only it has (`dpo.config.DPOModelArguments` adds the separate
reference; `reward.config.RewardModelArguments` defaults LoRA to sequence classification) and calls these
methods; TRL is imported only when a PEFT or quantization config is built (the commands parse with TRL anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixdpo.errors import ConfigError
from prefixdpo.training.options import changed_options, state_options_without_effect

# The fields `trl.get_peft_config` reads besides `use_peft`, and those `trl.get_quantization_config` reads
# besides the switch: without their switch they change nothing (TRL accepts them silently; we say so).
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
               "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora")
BNB_4BIT_FIELDS = ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")

ATTN_IMPLEMENTATION_HELP = (
    "Attention implementation the model (and a reference loaded by name) is loaded with, passed to "
    "from_pretrained as TRL does (eager, sdpa, flash_attention_2, flex_attention, a kernels-hub name; "
    "transformers checks it is available). How it combines with prefixdpo: every training and evaluation pass "
    "of the policy and the reference runs prefixdpo's own registered attention (the prefix-sharing mask), whose "
    "kernel is --attention; attn_implementation is the model's stock attention, what it is loaded and checked "
    "with. Not set: transformers' default.")


@dataclass
class ModelArguments:
    """TRL's `ModelConfig`: which model, how it is loaded (revision, dtype, attention, 4/8-bit) and whether LoRA
    adapters train instead of the whole model (`use_peft`)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model checkpoint for weights initialization: a Hub name or a local folder "
                                        "(default: the embedded demo model).", "aliases": ["--model"]})
    model_revision: str = field(
        default="main", metadata={"help": "Specific model version to use: a branch name, a tag name, or a commit "
                                          "id. Passed to from_pretrained of the model, its tokenizer and a "
                                          "reference loaded by name (model_init_kwargs' revision wins, as TRL)."})
    dtype: str | None = field(
        default="float32",
        metadata={"help": "Load the model under this dtype (TRL's default float32; --bf16 then autocasts with fp32 "
                          "master weights); auto: the checkpoint's own. Also the 4-bit compute dtype, as TRL.",
                  "choices": ["auto", "bfloat16", "float16", "float32"]})
    attn_implementation: str | None = field(default=None, metadata={"help": ATTN_IMPLEMENTATION_HELP})
    use_peft: bool = field(
        default=False, metadata={"help": "Train LoRA adapters (built by TRL's get_peft_config from the lora_* "
                                         "options) instead of the whole model. Without it the lora_* options "
                                         "change nothing (as TRL)."})
    lora_r: int = field(default=16, metadata={"help": "LoRA R value (with --use_peft)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (with --use_peft)."})
    lora_dropout: float = field(
        default=0.05, metadata={"help": "LoRA dropout (with --use_peft); 0 while disable_dropout is on, which "
                                        "turns every dropout off, LoRA's included, as TRL."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "LoRA target modules (with --use_peft). One name is read as PEFT reads a "
                                        "string, as TRL passes it: all-linear, or a regex matched against whole "
                                        "module names (.*q_proj). Not set: PEFT's default for the architecture "
                                        "(q_proj v_proj for Llama)."})
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "Parameters (not modules) to adapt with LoRA, e.g. MoE expert weights "
                                        "(with --use_peft)."})
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Model layers to unfreeze and train fully beside the adapters, e.g. lm_head "
                                        "(with --use_peft)."})
    lora_task_type: str = field(
        default="CAUSAL_LM", metadata={"help": "PEFT task type of the LoRA config (with --use_peft)."})
    use_rslora: bool = field(
        default=False, metadata={"help": "Rank-Stabilized LoRA: adapter scaling lora_alpha/sqrt(r) instead of "
                                         "lora_alpha/r (with --use_peft)."})
    use_dora: bool = field(
        default=False, metadata={"help": "Weight-Decomposed Low-Rank Adaptation (DoRA, "
                                         "https://huggingface.co/papers/2402.09353): LoRA gives the direction, a "
                                         "learned magnitude vector per weight the norm (with --use_peft)."})
    load_in_8bit: bool = field(
        default=False, metadata={"help": "Load the base model in 8 bit (bitsandbytes, CUDA). Works only with "
                                         "--use_peft."})
    load_in_4bit: bool = field(
        default=False, metadata={"help": "Load the base model in 4 bit (QLoRA; bitsandbytes, CUDA). Works only with "
                                         "--use_peft."})
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "4-bit quantization type (with --load_in_4bit).", "choices": ["fp4", "nf4"]})
    use_bnb_nested_quant: bool = field(
        default=False, metadata={"help": "Nested (double) quantization of the 4-bit constants (with --load_in_4bit)."})
    bnb_4bit_quant_storage: str | None = field(
        default=None, metadata={"help": "Storage dtype of the 4-bit weights (with --load_in_4bit; not set: uint8)."})

    def __post_init__(self) -> None:
        if self.load_in_8bit and self.load_in_4bit:
            raise ConfigError("load_in_8bit and load_in_4bit: use one precision for the base model, not both")
        if self.quantized and not self.use_peft:
            # transformers' Trainer refuses to train a purely quantized model; say so before any work
            raise ConfigError(f"{self.quantized_option} needs --use_peft: a quantized base model is frozen, only "
                              "LoRA adapters train (QLoRA)")
        if hasattr(self.lora_target_modules, "__len__") and len(self.lora_target_modules) == 1:
            # TRL's rule: one name is a string, which PEFT reads as a pattern ("all-linear") or a regex
            self.lora_target_modules = self.lora_target_modules[0]
        state_options_without_effect(self.options_without_effect())

    @property
    def quantized(self) -> bool:
        return self.load_in_4bit or self.load_in_8bit

    @property
    def quantized_option(self) -> str:
        return "load_in_4bit" if self.load_in_4bit else "load_in_8bit"

    def options_without_effect(self) -> list[str]:
        """One line per group of TRL options set to something that changes nothing here: LoRA's without
        `use_peft` (the old prefixdpo spelling `--lora_r 16` alone turned LoRA on; TRL's, kept here, does not),
        the 4-bit ones without `load_in_4bit`."""
        changed = changed_options(self)
        lines = []
        for switch, names in (("use_peft", LORA_FIELDS), ("load_in_4bit", BNB_4BIT_FIELDS)):
            unused = [f"{name}={getattr(self, name)}" for name in names if name in changed]
            if unused and not getattr(self, switch):
                what = "full fine-tuning runs; add --use_peft to train LoRA adapters" if switch == "use_peft" else \
                    "the model is not loaded in 4 bit"
                lines.append(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without "
                             f"{switch} ({what}, as TRL)")
        return lines

    def options_without_effect_in(self, config) -> list[str]:
        """The lines of `options_without_effect` that need the training config: LoRA's dropout where
        `disable_dropout` (TRL's default) turns every dropout off, LoRA's too, as TRL's trainers do."""
        if self.use_peft and "lora_dropout" in changed_options(self) and config.disable_dropout:
            return [f"lora_dropout={self.lora_dropout} has no effect with disable_dropout (on by default, as TRL: "
                    "every dropout is off, LoRA's too): add --disable_dropout false to use it"]
        return []

    def peft_config(self):
        """TRL's `get_peft_config(self)`: a `peft.LoraConfig` when `use_peft`, else None."""
        if not self.use_peft:
            return None
        from trl import get_peft_config

        return get_peft_config(self)

    def quantization_config(self):
        """TRL's `get_quantization_config(self)`: a `BitsAndBytesConfig` for load_in_4bit / load_in_8bit, else None;
        a `ConfigError` where this machine cannot load it."""
        if not self.quantized:
            return None
        from prefixdpo.core.models import check_quantization_available
        from trl import get_quantization_config

        check_quantization_available(self.quantized_option)
        try:
            return get_quantization_config(self)
        except (ValueError, TypeError, AttributeError) as err:  # e.g. a compute dtype bitsandbytes cannot use
            reason = " ".join(str(err).split())
            raise ConfigError(f"{self.quantized_option} with dtype={self.dtype}: {reason}") from None

    def script_model_init_kwargs(self, model_init_kwargs: dict | None = None, trust_remote_code: bool = False) -> dict:
        """The training config's `model_init_kwargs` as TRL's scripts set them: revision, trust_remote_code,
        attn_implementation and dtype, updated with the given `model_init_kwargs` (theirs win). TRL's trainers load
        every model they are given by name with these (a reference, a reward model)."""
        return {"revision": self.model_revision, "trust_remote_code": trust_remote_code,
                "attn_implementation": self.attn_implementation, "dtype": self.dtype, **(model_init_kwargs or {})}

    def from_pretrained_kwargs(self, model_init_kwargs: dict | None = None, trust_remote_code: bool = False,
                               device_index: int = 0) -> dict:
        """What TRL's scripts load the model with (`script_model_init_kwargs`), then the quantization config and,
        for a quantized load, the device map that puts the whole model on this process's device
        (`device_index`, its local rank: bitsandbytes weights cannot move after loading)."""
        kwargs = self.script_model_init_kwargs(model_init_kwargs, trust_remote_code)
        quantization = self.quantization_config()
        if quantization is not None:
            if "quantization_config" in (model_init_kwargs or {}):
                raise ConfigError(f"{self.quantized_option} and model_init_kwargs quantization_config both quantize "
                                  "the model: set one")
            kwargs["quantization_config"] = quantization
            kwargs.setdefault("device_map", {"": device_index})
        return kwargs
