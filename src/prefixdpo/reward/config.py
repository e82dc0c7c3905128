"""`PrefixRewardConfig`: reward-model training options; every field of TRL 1.16's `RewardConfig` with its
name, type, default and meaning, plus the prefix-sharing options of `PrefixDPOConfig`.

It extends `transformers.TrainingArguments` (every Trainer option works unchanged) with TRL's reward
defaults (learning_rate 1e-4, logging_steps 10, gradient checkpointing on, bf16 where the device has it).
The command line reads these with `prefixdpo.commands.options.parse_options(REWARD_OPTIONS, argv)`, the same
parser rules as `prefixdpo train`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from prefixdpo.errors import ConfigError
from prefixdpo.training.model_options import ModelArguments
from prefixdpo.training.options import (
    DataArguments, PrefixReuseOptions, PrefixSharingOptions, RunSafetyOptions, SequenceParallelOptions,
    check_shared_options, pipeline_options, resolve_before_trainer_args,
)


@dataclass
class PrefixRewardConfig(PrefixSharingOptions, PrefixReuseOptions, RunSafetyOptions, SequenceParallelOptions,
                      TrainingArguments):
    """Options of `PrefixRewardTrainer` (TRL `RewardConfig` names + prefix-sharing options + TrainingArguments)."""

    # ---- TrainingArguments defaults that TRL's RewardConfig changes ----
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate (TRL's reward default)."})
    logging_steps: float = field(
        default=10, metadata={"help": "Log every N optimizer steps (a float < 1: that fraction of all steps)."})
    gradient_checkpointing: bool = field(
        default=True, metadata={"help": "Recompute activations in the backward pass (TRL's default: on)."})
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision. Not set (TRL's default): on where the device has "
                                        "bf16 and fp16 is off (CUDA Ampere+, XPU, NPU, TPU); off on CPU."})
    remove_unused_columns: bool = field(
        default=True, metadata={"help": "Accepted, no effect: records' fields are read by prefixdpo, other "
                                        "columns ignored."})
    ddp_find_unused_parameters: bool | None = field(
        default=None, metadata={"help": "DDP's find_unused_parameters. Not set: False (every parameter is used "
                                        "in every step)."})
    output_dir: str | None = field(default="prefixdpo-output", metadata={"help": "Where checkpoints and the model go."})
    report_to: None | str | list[str] = field(
        default="none", metadata={"help": "Integrations to report to (tensorboard, wandb, ...; 'none')."})

    # ---- TRL RewardConfig names ----
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments for AutoModelForSequenceClassification.from_pretrained "
                                        "when the model is given by name (dtype, revision, ...); a JSON object."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow models with custom code."})
    chat_template_path: str | None = field(
        default=None, metadata={"help": "A .jinja/.j2 chat template file for the tokenizer (TRL also clones a "
                                        "template from a model, which adds tokens: not supported here)."})
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the model."})
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Accepted, no effect: records are tokenized in batched calls."})
    eos_token: str | None = field(
        default=None, metadata={"help": "End-of-sequence token appended to text responses (default: the "
                                        "tokenizer's)."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Max tokens of each prompt + response sequence; longer records are "
                                        "dropped as TRL filters them (--overlong truncate cuts them instead)."})
    pad_to_multiple_of: int | str | None = field(
        default="auto", metadata={"help": "Pad unpacked lines to a multiple of this; 'auto': 128 on Neuron, "
                                          "else no padding."})
    center_rewards_coefficient: float | None = field(
        default=None, metadata={"help": "Adds c * mean((r_chosen + r_rejected)^2) to the loss "
                                        "(https://huggingface.co/papers/2312.09244; 0.01 recommended)."})
    activation_offloading: bool = field(
        default=False, metadata={"help": "Offload activations to CPU memory during the forward (CUDA only)."})
    pad_token: str | None = field(
        default=None, metadata={"help": "Deprecated in TRL: the pad token (default: the tokenizer's, else its "
                                        "EOS token). It decides where a sequence's score is read."})

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs"]

    def __post_init__(self) -> None:
        resolve_before_trainer_args(self)
        super().__post_init__()
        check_shared_options(self)
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"max_length={self.max_length}: must be >= 1 (or none)")
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ConfigError(f"center_rewards_coefficient={self.center_rewards_coefficient}: must be >= 0")


@dataclass
class RewardModelArguments(ModelArguments):
    """TRL's `ModelConfig` (`training.model_options.ModelArguments`), with LoRA for sequence classification."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "HF model name or local path, a causal LM (it gets a new score head) or a "
                                        "sequence classifier (default: the demo model).", "aliases": ["--model"]})
    # TRL's default CAUSAL_LM would wrap the reward model so that its new score head never trains (TRL's own
    # reward docs pass --lora_task_type SEQ_CLS for that reason); SEQ_CLS makes PEFT train the head fully.
    lora_task_type: str = field(
        default="SEQ_CLS", metadata={"help": "PEFT task type of the LoRA config (with --use_peft): SEQ_CLS, so the "
                                             "score head trains fully beside the adapters (TRL's docs pass "
                                             "--lora_task_type SEQ_CLS for reward models; its default CAUSAL_LM "
                                             "would leave the new head at its random init)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.use_peft and self.lora_task_type != "SEQ_CLS":
            raise ConfigError(f"lora_task_type={self.lora_task_type} would leave the reward model's score head "
                              "frozen (at its random init for a causal LM): use SEQ_CLS, the default here")


@dataclass
class RewardDataArguments(DataArguments):
    """`DataArguments`, with TRL's reward rule for long records: dropped (TRL filters them), not truncated."""

    overlong: str = field(default="drop", metadata={"help": "Records with a prompt + response over max_length: "
                                                            "drop (TRL's RewardTrainer) or truncate."})


def reward_data_options(config: PrefixRewardConfig, data: DataArguments | None = None):
    """The data pipeline's `DataOptions` for reward training (lengths from `config`, the rest from `data`; None: the
    trainer's own, which reads no held-out split from a training dataset)."""
    return pipeline_options(config, data, RewardDataArguments())


REWARD_OPTIONS = (PrefixRewardConfig, RewardModelArguments, RewardDataArguments)  # what `prefixdpo reward` parses
