"""`PrefixRewardConfig`: reward-model training options; every field of TRL 1.16's `RewardConfig` with its
name, type, default and meaning, plus the prefix-sharing options of `PrefixDPOConfig`.

It extends `transformers.TrainingArguments` (every Trainer option works unchanged) with TRL's reward
defaults (learning_rate 1e-4, logging_steps 10, gradient checkpointing on, bf16 where the device has it).
`parse_reward_args(["config.yaml", "--center_rewards_coefficient", "0.01"])` reads the options of
`prefixdpo reward` (YAML, then the command line), with the same parser rules as `prefixdpo train`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from prefixdpo.core.attention.backends import BACKENDS
from prefixdpo.dpo.config import (
    DataArguments, _device_has_bf16, _pad_multiple, _train_argument_parser, join_cpu_processes,
    refuse_or_state_options_without_effect,
)
from prefixdpo.errors import ConfigError
from prefixdpo.training.nonfinite import NONFINITE_HELP, NONFINITE_MAX_CONSECUTIVE_HELP, POLICIES, check_nonfinite_options


@dataclass
class PrefixRewardConfig(TrainingArguments):
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
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an output_dir that holds another run (checkpoints or a model with another "
                          "fingerprint: model, data or options): its checkpoints are deleted first. Off: refused. "
                          "(The name older TrainingArguments used; transformers 5 dropped it.)"},
    )
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

    # ---- prefix sharing (as PrefixDPOConfig) ----
    prefix_sharing: bool = field(default=True, metadata={"help": "Prompt once + all responses in one row."})
    packing: bool = field(default=False, metadata={"help": "Pack several rows per line."})
    pack_length: str = field(default="auto", metadata={"help": "Packed line length: 'auto' or an int."})
    attention: str = field(default="auto", metadata={"help": f"Attention backend: {', '.join(BACKENDS)}."})
    # ---- a run that survives (as PrefixDPOConfig) ----
    nonfinite: str = field(default="stop", metadata={"help": NONFINITE_HELP, "choices": list(POLICIES)})
    nonfinite_max_consecutive: int = field(default=10, metadata={"help": NONFINITE_MAX_CONSECUTIVE_HELP})

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs"]

    def __post_init__(self) -> None:
        if self.bf16 is None:  # TRL: `not fp16`; here only where the device has bf16 (a CPU run is fp32)
            self.bf16 = not self.fp16 and _device_has_bf16(self.use_cpu)
        # TRL's gradient_checkpointing names are transformers' deprecated aliases: set the new ones too
        self.activation_checkpointing = (self.gradient_checkpointing if self.activation_checkpointing is None
                                         else self.activation_checkpointing)
        self.activation_checkpointing_kwargs = (self.activation_checkpointing_kwargs
                                                or self.gradient_checkpointing_kwargs or {"use_reentrant": False})
        self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs
        if self.ddp_find_unused_parameters is None:
            self.ddp_find_unused_parameters = False
        join_cpu_processes(self)
        super().__post_init__()
        self.pad_to_multiple_of = _pad_multiple(self.pad_to_multiple_of, self.use_cpu)
        self._check()
        check_nonfinite_options(self.nonfinite, self.nonfinite_max_consecutive)

    def _check(self) -> None:
        problems = []
        if self.model_init_kwargs is not None and not isinstance(self.model_init_kwargs, dict):
            problems.append(f"model_init_kwargs={self.model_init_kwargs!r}: expected a JSON object")
        if self.attention not in BACKENDS:
            problems.append(f"attention={self.attention!r}: choose one of {', '.join(BACKENDS)}")
        if self.max_length is not None and self.max_length < 1:
            problems.append(f"max_length={self.max_length}: must be >= 1 (or none)")
        if self.train_sampling_strategy not in ("random", "sequential"):
            problems.append(f"train_sampling_strategy={self.train_sampling_strategy!r}: prefixdpo supports "
                            "'random' and 'sequential'")
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            problems.append(f"center_rewards_coefficient={self.center_rewards_coefficient}: must be >= 0")
        if str(self.pack_length) != "auto":
            try:
                self.pack_length = int(self.pack_length)
            except ValueError:
                self.pack_length = -1
            if self.pack_length < 1:
                problems.append("pack_length: expected 'auto' or a positive integer")
        if problems:
            raise ConfigError("; ".join(problems))
        refuse_or_state_options_without_effect(self)  # pack_length without packing


@dataclass
class RewardModelArguments:
    """Which model to train as a reward model, and how (LoRA on the body; the new score head trains fully)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "HF model name or local path, a causal LM or a sequence classifier "
                                        "(default: the demo model).", "aliases": ["--model"]})
    dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32 (default; --bf16 autocasts), "
                                                            "bfloat16, float16, or auto (the checkpoint's)."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 = full fine-tuning."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt (default: all linear layers but the score head)."})

    def peft_config(self):
        """A sequence-classification `peft.LoraConfig` (PEFT trains the `score` head fully) when lora_r > 0."""
        if self.lora_r <= 0:
            return None
        from peft import LoraConfig

        return LoraConfig(task_type="SEQ_CLS", r=self.lora_r, lora_alpha=self.lora_alpha,
                          lora_dropout=self.lora_dropout, target_modules=self.lora_target_modules or "all-linear")


@dataclass
class RewardDataArguments(DataArguments):
    """`DataArguments`, with TRL's reward rule for long records: dropped (TRL filters them), not truncated."""

    overlong: str = field(default="drop", metadata={"help": "Records with a prompt + response over max_length: "
                                                            "drop (TRL's RewardTrainer) or truncate."})


def reward_data_options(config: PrefixRewardConfig, data: DataArguments | None = None):
    """The data pipeline's `DataOptions` for reward training (lengths from `config`, the rest from `data`)."""
    from prefixdpo.data.prepare import DataOptions

    data = data or RewardDataArguments()
    return DataOptions(max_length=config.max_length, overlong=data.overlong, invalid=data.invalid,
                       pairs_policy=data.pairs_policy, max_samples=data.max_samples, split=data.dataset_train_split,
                       eval_split=data.dataset_test_split, dataset_config=data.dataset_config)


def reward_argument_parser(**kwargs):
    """`prefixdpo train`'s parser (YAML + command line, every boolean as --X/--X false/--no_X, one-line
    errors) over the reward dataclasses instead of the DPO ones."""
    train_parser = _train_argument_parser()

    class _RewardTypes(train_parser.__mro__[1]):  # sits between the train parser and TrlParser
        def __init__(self, _dpo_types, **kw):
            super().__init__((PrefixRewardConfig, RewardModelArguments, RewardDataArguments), **kw)

    class RewardArgumentParser(train_parser, _RewardTypes):
        def parse(self, argv):
            try:
                return super().parse(argv)
            except ConfigError as err:
                raise ConfigError(str(err).replace("prefixdpo train", "prefixdpo reward")) from None

    return RewardArgumentParser(**kwargs)


def parse_reward_args(argv: list[str] | None = None, demo_defaults: dict[str, str] | None = None, **parser_kwargs):
    """`[config.yaml] [--option value ...]` -> (PrefixRewardConfig, RewardModelArguments, RewardDataArguments);
    `demo_defaults` apply where nothing sets the option and neither a model nor a dataset is named."""
    argv = list(argv or [])
    parser = reward_argument_parser(**parser_kwargs)
    if argv and not argv[0].startswith("-"):
        parser.read_config_file(argv.pop(0))
    if demo_defaults and not parser.names_model_or_dataset(argv):
        parser.set_defaults(**{k: v for k, v in demo_defaults.items() if k not in parser.configured})
    return parser.parse(argv)
