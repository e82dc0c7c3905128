"""Options of the group-RL trainers and commands.

`PrefixGRPOConfig` / `PrefixRLOOConfig`: TRL 1.16's `GRPOConfig` / `RLOOConfig` (every field, with TRL's name,
default and meaning) plus `GroupLayoutOptions`, the layout of the log-prob passes, and `RunSafetyOptions`
(`nonfinite`, `nonfinite_max_consecutive`, `overwrite_output_dir`, as for DPO). One resolution differs from
TRL's, as in `PrefixDPOConfig`: `bf16` not set means bf16 where the device computes in it natively (CUDA
Ampere+, XPU, NPU, TPU), fp32 elsewhere; TRL turns it on everywhere, which a CPU run without `use_cpu` refuses.

`GroupModelArguments` / `GroupScriptArguments`: the model, the dataset and the rewards of `prefixdpo grpo` /
`prefixdpo rloo`: the argument classes TRL's `trl grpo` / `trl rloo` scripts parse (TRL 1.16's `ModelConfig`, and
`GRPOScriptArguments`, i.e. `ScriptArguments` + the rewards, field for field; tests/test_trl_model_config.py walks
them), parsed with the parser of every prefixdpo command (`prefixdpo.commands.options`, by
`prefixdpo.commands.grpo.parse_group_args`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig, RLOOConfig

from prefixdpo.errors import ConfigError
from prefixdpo.training.model_options import ModelArguments
from prefixdpo.training.nonfinite import check_nonfinite_options
from prefixdpo.training.options import (
    PACKING_HELP, PrefixReuseOptions, RecordSizeOptions, RunSafetyOptions, ScriptArguments, SequenceParallelOptions,
    SharedLineOptions, check_attention_and_pack_length, check_prefix_reuse, check_sequence_parallel, device_has_bf16,
    join_cpu_processes,
)


@dataclass
class GroupLayoutOptions(SharedLineOptions):
    """How the per-token log-prob passes lay out TRL's rows (`SharedLineOptions`: prefix sharing, packing, the
    line length, the attention backend), how generation prefills the prompts, and how reward models score (none of
    these changes a result beyond float rounding)."""

    # on by default here (off for DPO/reward, where a batch counts lines): TRL's batch counts completions either way
    packing: bool = field(default=True, metadata={"help": PACKING_HELP})
    shared_prompt_generation: bool = field(
        default=True,
        metadata={"help": "transformers generate (use_vllm false): prefill each unique prompt once, then decode with "
                          "transformers' generate and TRL's generation config over a cache holding each prompt's keys "
                          "and values once, read by its num_generations rows (cascade attention; same seed, same "
                          "completions as TRL's). Falls back to TRL's call, said once, for beam search, static/quantized caches, "
                          "images, active dropout. With use_vllm it does nothing: TRL's server mode already sends "
                          "each prompt once with n=num_generations, and colocate mode sends the copies to vLLM, "
                          "whose automatic prefix caching (on by default in its V1 engine) computes a prompt's full "
                          "KV blocks once for the requests that share them (checked at start, said if off)."},
    )
    shared_prompt_scoring: bool = field(
        default=True,
        metadata={"help": "Reward models among reward_funcs score each prompt's completions on one prefix-shared "
                          "line (the tokens the completions share computed once; off: TRL's padded rows)."},
    )

    def _resolve_before_trl(self) -> None:
        """TRL's defaults where they need the device (see the module doc); before TRL's own `__post_init__`."""
        join_cpu_processes(self)  # torchrun on a CPU machine: one gloo job, not N runs writing one output_dir
        if self.bf16 is None:
            self.bf16 = not self.fp16 and device_has_bf16(self.use_cpu)
        # TRL's name; transformers calls it a deprecated alias of activation_checkpointing and warns unless set
        if getattr(self, "activation_checkpointing", False) is None:  # transformers 5.17 has only TRL's name
            self.activation_checkpointing = self.gradient_checkpointing

    def _check_prefix_options(self) -> None:
        check_attention_and_pack_length(self)
        check_nonfinite_options(self.nonfinite, self.nonfinite_max_consecutive)
        check_prefix_reuse(self)
        check_sequence_parallel(self)
        if self.sequence_parallel_size > 1 and not self.prefix_sharing:
            raise ConfigError(f"sequence_parallel_size={self.sequence_parallel_size} runs the prefix-shared passes: "
                              "set prefix_sharing true")


@dataclass
class PrefixGRPOConfig(GroupLayoutOptions, PrefixReuseOptions, RunSafetyOptions, SequenceParallelOptions, GRPOConfig):
    """Options of `PrefixGRPOTrainer`: TRL's `GRPOConfig` + `GroupLayoutOptions` + `RunSafetyOptions` (a non-finite
    step, an output_dir of another run)."""

    def __post_init__(self) -> None:
        self._resolve_before_trl()
        super().__post_init__()
        self._check_prefix_options()


@dataclass
class PrefixRLOOConfig(GroupLayoutOptions, PrefixReuseOptions, RunSafetyOptions, SequenceParallelOptions, RLOOConfig):
    """Options of `PrefixRLOOTrainer`: TRL's `RLOOConfig` + `GroupLayoutOptions` + `RunSafetyOptions`."""

    def __post_init__(self) -> None:
        self._resolve_before_trl()
        super().__post_init__()
        self._check_prefix_options()


# Why `--dataset_streaming` is refused here (the DPO and reward commands give their own reason).
GROUP_STREAMING_REFUSED = (
    "prefixdpo grpo/rloo check every prompt record before the first step (a bad one is named, or skipped and "
    "counted, before any work) and hand TRL the checked split, so a streamed split would be read whole: load it "
    "without streaming (datasets caches it on disk)")

# TRL's `trl grpo` script registry (its names, and the arguments it gives the one factory).
TRL_REWARD_NAMES = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                    "get_soft_overlong_punishment")


@dataclass
class GroupModelArguments(ModelArguments):
    """TRL's `ModelConfig` (`training.model_options.ModelArguments`, as `prefixdpo train` has it): the policy, how
    it is loaded, LoRA exactly with `use_peft`. The reference, where beta > 0, is TRL's: the LoRA policy with its
    adapter off, else the same checkpoint loaded with the same arguments (`model_init_kwargs`, as TRL's script)."""


@dataclass
class GroupScriptArguments(RecordSizeOptions, ScriptArguments):
    """TRL's `GRPOScriptArguments` / `RLOOScriptArguments` (`ScriptArguments` + the rewards), and how records are
    read (`max_samples`, `invalid`, `max_record_bytes`)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "HF dataset name, or a .jsonl/.json/.parquet/.csv path or save_to_disk folder of records "
                          "with a 'prompt' (text or a list of messages); other fields reach the reward functions "
                          "(default: the demo prompts).", "aliases": ["--dataset"]},
    )
    dataset_streaming: bool = field(
        default=False,
        metadata={"help": f"TRL: load the dataset in streaming mode. Refused: {GROUP_STREAMING_REFUSED}"})
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A reward model (sequence classifier) by HF name or local path, as TRL "
                                        "(loaded with model_init_kwargs, which the model options fill as TRL's "
                                        "script does)."}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": f"Reward functions: TRL's {', '.join(TRL_REWARD_NAMES)} (get_soft_overlong_punishment with "
                          "TRL's max_completion_len=1280, soft_punish_cache=256), module:function / "
                          "module.function (a module on the Python path or in the current folder), or a reward "
                          "model: a folder with a saved model or a hub id org/name (scored prefix-shared, see "
                          "shared_prompt_scoring)."},
    )
    max_samples: int | None = field(default=None, metadata={"help": "Use only the first N records."})
    invalid: str = field(default="error", metadata={"help": "Invalid records: error or skip (counted)."})

    def streaming_refused(self) -> str:
        return GROUP_STREAMING_REFUSED


def group_options(config_class) -> tuple:
    """What `prefixdpo grpo` / `rloo` parse: `config_class` (PrefixGRPOConfig or PrefixRLOOConfig), the model and
    the script's arguments."""
    return (config_class, GroupModelArguments, GroupScriptArguments)
