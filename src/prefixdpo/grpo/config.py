"""Options of the group-RL trainers and commands.

`PrefixGRPOConfig` / `PrefixRLOOConfig`: TRL 1.16's `GRPOConfig` / `RLOOConfig` (every field, with TRL's name,
default and meaning) plus `GroupLayoutOptions`, the layout of the log-prob passes. One resolution differs from
TRL's, as in `PrefixDPOConfig`: `bf16` not set means bf16 where the device computes in it natively (CUDA
Ampere+, XPU, NPU, TPU), fp32 elsewhere; TRL turns it on everywhere, which a CPU run without `use_cpu` refuses.

`GroupModelArguments` / `GroupScriptArguments`: the model, the dataset and the rewards of `prefixdpo grpo` /
`prefixdpo rloo` (TRL's `trl grpo` script names), parsed with the parser of every prefixdpo command
(`prefixdpo.option_parser`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig, RLOOConfig

from prefixdpo.option_parser import parse_options
from prefixdpo.training.options import check_attention_and_pack_length, device_has_bf16


@dataclass
class GroupLayoutOptions:
    """How the per-token log-prob passes lay out TRL's rows (none of these changes a result)."""

    prefix_sharing: bool = field(
        default=True,
        metadata={"help": "Run each prompt once with its completions as branches after it (off: TRL's own passes)."},
    )
    packing: bool = field(
        default=True, metadata={"help": "Pack several prompts' groups into one line (each attends only to itself)."}
    )
    pack_length: str = field(
        default="auto",
        metadata={"help": "Packed line length: 'auto' (1.1 x the 95th percentile of a pass's group lengths, rounded "
                          "up to 128) or an int; a longer group gets a line of its own."},
    )
    attention: str = field(
        default="auto",
        metadata={"help": "Attention backend of the log-prob passes: auto (flex on CUDA, sdpa else), sdpa, flex, "
                          "segmented, varlen (CUDA). Generation keeps the model's stock attention path."},
    )

    def _resolve_before_trl(self) -> None:
        """TRL's defaults where they need the device (see the module doc); before TRL's own `__post_init__`."""
        if self.bf16 is None:
            self.bf16 = not self.fp16 and device_has_bf16(self.use_cpu)
        # TRL's name; transformers calls it a deprecated alias of activation_checkpointing and warns unless set
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing

    def _check_prefix_options(self) -> None:
        check_attention_and_pack_length(self)


@dataclass
class PrefixGRPOConfig(GroupLayoutOptions, GRPOConfig):
    """Options of `PrefixGRPOTrainer`: TRL's `GRPOConfig` + `GroupLayoutOptions`."""

    def __post_init__(self) -> None:
        self._resolve_before_trl()
        super().__post_init__()
        self._check_prefix_options()


@dataclass
class PrefixRLOOConfig(GroupLayoutOptions, RLOOConfig):
    """Options of `PrefixRLOOTrainer`: TRL's `RLOOConfig` + `GroupLayoutOptions`."""

    def __post_init__(self) -> None:
        self._resolve_before_trl()
        super().__post_init__()
        self._check_prefix_options()


# TRL's `trl grpo` script registry (its names, and the arguments it gives the one factory).
TRL_REWARD_NAMES = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                    "get_soft_overlong_punishment")


@dataclass
class GroupModelArguments:
    """The policy (the reference, where beta > 0, is TRL's: the same checkpoint, or the LoRA policy's base)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "HF model name or local path (default: the demo model).", "aliases": ["--model"]},
    )
    dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32 (default; --bf16 then autocasts), "
                                                            "bfloat16, float16, or auto (the checkpoint's own)."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 = full fine-tuning."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt (default: all linear)."}
    )

    def peft_config(self):
        """A `peft.LoraConfig` when lora_r > 0, else None."""
        if self.lora_r <= 0:
            return None
        from peft import LoraConfig

        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=self.lora_target_modules or "all-linear", task_type="CAUSAL_LM")


@dataclass
class GroupScriptArguments:
    """The prompts and the rewards (TRL's `GRPOScriptArguments` names)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "HF dataset name, or a .jsonl/.json/.parquet/.csv path or save_to_disk folder of records "
                          "with a 'prompt' (text or a list of messages); other fields reach the reward functions "
                          "(default: the demo prompts).", "aliases": ["--dataset"]},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split (TRL name)."})
    dataset_test_split: str | None = field(default=None, metadata={"help": "Evaluation split (TRL name)."})
    max_samples: int | None = field(default=None, metadata={"help": "Use only the first N records."})
    invalid: str = field(default="error", metadata={"help": "Invalid records: error or skip (counted)."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": f"Reward functions: TRL's {', '.join(TRL_REWARD_NAMES)} (get_soft_overlong_punishment with "
                          "TRL's max_completion_len=1280, soft_punish_cache=256), or module:function / "
                          "module.function (a module on the Python path or in the current folder)."},
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A reward model (sequence classifier) by HF name or local path, as TRL."}
    )


def parse_group_args(config_class, command: str, argv: list[str] | None = None,
                     demo_defaults: dict[str, str] | None = None, **parser_kwargs):
    """`[config.yaml] [--option value ...]` -> (config, GroupModelArguments, GroupScriptArguments): the command line
    overrides the YAML file; `demo_defaults` apply where neither sets the option and neither names a model or a
    dataset (the embedded default)."""
    return parse_options(group_options(config_class), argv, demo_defaults=demo_defaults,
                         **{"prog": f"prefixdpo {command}", **parser_kwargs})


def group_options(config_class) -> tuple:
    """What `prefixdpo grpo` / `rloo` parse: `config_class` (PrefixGRPOConfig or PrefixRLOOConfig), the model and
    the script's arguments."""
    return (config_class, GroupModelArguments, GroupScriptArguments)
