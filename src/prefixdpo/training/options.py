"""Options every prefixdpo trainer shares, whatever it trains: the prefix-sharing layout, a run that survives,
the dataset to read, and the checks and TRL-style resolutions (bf16, checkpointing names, padding) that every
method's config applies. Each method's config (`dpo/config.py`, `reward/config.py`) is a dataclass over
`transformers.TrainingArguments` that inherits these fields; the command line reads them with
`prefixdpo.commands.options`."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields

from prefixdpo.core.attention.backends import BACKENDS
from prefixdpo.data.record_lines import DEFAULT_MAX_RECORD_BYTES, MAX_RECORD_BYTES_HELP, check_max_record_bytes
from prefixdpo.errors import ConfigError
from prefixdpo.training.nonfinite import NONFINITE_HELP, NONFINITE_MAX_CONSECUTIVE_HELP, POLICIES, check_nonfinite_options

ATTENTION_HELP = ("Attention backend: auto (flex on CUDA, sdpa else), sdpa, flex, segmented (SDPA over allowed "
                  "blocks only; faster on CPU for long packed lines), varlen (FlashAttention varlen over allowed "
                  "blocks; CUDA, bf16/fp16). The kernel of prefixdpo's registered attention, which every training "
                  "and evaluation pass uses whatever the model's attn_implementation (that one only says how the "
                  "model is loaded). GRPO/RLOO: the backend of the log-prob passes; generation keeps the model's "
                  "stock attention path.")

GROUP_BY_PROMPT_HELP = (
    "Records whose prompts are the same tokens become one row: the prompt once, then every response they name "
    "(a response named by several records once). Every pair and its loss stay the same, but, as group_by_length "
    "does, it changes which pairs share an optimizer step: a batch counts rows, so a step holds all pairs of its "
    "prompts, and an epoch has fewer, larger steps. Off by default so that a TRL config trains on the same steps "
    "as TRL; turn it on for data with several pairs per prompt (SHP, all-pairs expansions, several rated "
    "responses per prompt): `prefixdpo inspect` shows what it saves. Needs prefix_sharing; with packing and an "
    "explicit pack_length a group too long for a line is split, each part repeating the prompt (counted).")


PREFIX_TREE_HELP = (
    "Packed lines become token tries across their records (DPO and reward-model training): tokens several records "
    "share from "
    "their start (a system prompt, a prompt several records name, the earlier turns of a dialogue) run once per "
    "line, every pair's loss unchanged. Needs prefix_sharing and packing. "
    "Off by default because, as group_by_prompt, it changes which pairs share an optimizer step: a line holds "
    "whole subtrees (the records sharing a prefix together, the subtrees packed best fit; the same lines every "
    "epoch, in a shuffled order); a subtree too big for a line is split, each part repeating the shared prefix "
    "(counted). "
    "`prefixdpo inspect` shows what it saves.")


PREFIX_SHARING_HELP = (
    "Run each prompt once with all its responses (GRPO/RLOO: its completions) as branches after it in one row, each "
    "branch attending to the prompt and itself only (off: the standard padded rows, TRL's own passes; a model "
    "whose layers prefix sharing cannot run yet, e.g. a hybrid with recurrent or convolution layers, then runs its "
    "own attention with a padding mask, exactly as TRL's trainers run it).")
PACKING_HELP = ("Pack several prefix-shared rows into one line, each attending only to itself (DPO and reward: "
                "per_device_train_batch_size then counts lines).")
PACK_LENGTH_HELP = ("Packed line length: 'auto' (1.1 x the 95th percentile of the rows' lengths, rounded up to 128, "
                    "never below the longest row) or an int.")


@dataclass
class SharedLineOptions:
    """What every prefix-shared trainer lays out the same way: sharing on or off, packing, the line length and the
    attention backend (DPO and reward: `PrefixSharingOptions`; GRPO/RLOO: `grpo.config.GroupLayoutOptions`)."""

    prefix_sharing: bool = field(default=True, metadata={"help": PREFIX_SHARING_HELP})
    packing: bool = field(default=False, metadata={"help": PACKING_HELP})
    pack_length: str = field(default="auto", metadata={"help": PACK_LENGTH_HELP})
    attention: str = field(default="auto", metadata={"help": ATTENTION_HELP})


@dataclass
class PrefixSharingOptions(SharedLineOptions):
    """How examples become lines: one prefix-shared row per example, packed or not, the attention backend, and
    the sharing across records (`group_by_prompt`, `prefix_tree`)."""

    group_by_prompt: bool = field(default=False, metadata={"help": GROUP_BY_PROMPT_HELP})
    prefix_tree: bool = field(default=False, metadata={"help": PREFIX_TREE_HELP})


PREFIX_REUSE_HELP = (
    "A prefix-shared example (a prompt and its responses, a GRPO prompt and its completions, a trie) longer than "
    "max_tokens_per_pass runs its shared prefix once, keeping each layer's keys and values, and its responses in "
    "chunks of at most max_tokens_per_pass tokens against them (`core.prefix_reuse`): the same loss and gradients "
    "as one row, with the activations of the prefix and one chunk alive instead of the whole row's, for one more "
    "forward of the response tokens of every chunk but the last (recomputed in backward; never the prefix). Shorter "
    "examples run as one row, unchanged. Examples run unpacked (packing false; GRPO's over-long groups get a line of "
    "their own); not with the MoE load-balancing loss (its router logits come in chunks). With several ranks (DDP, "
    "FSDP2, ZeRO-3) the ranks agree on each micro-batch's passes and a rank with fewer runs one-token stand-ins "
    "that add zero, so every rank makes the same layer calls, as FSDP2's and ZeRO-3's per-layer gathers need; "
    "under FSDP2 with reshard_after_forward (FULL_SHARD) each pass gathers each layer again: one all-gather per "
    "layer per pass in forward and one in backward (SHARD_GRAD_OP: one per layer for all forward passes).")
MAX_TOKENS_PER_PASS_HELP = (
    "prefix_reuse: the tokens of a line above which it runs its prefix once and its responses in chunks of at most "
    "this many (an int), or 'auto': the budget this device's memory allows (`core.fit.auto_tokens_per_pass`, an "
    "estimate of activation memory per token from the model's shape). A prefix (prompt), or a single response, "
    "longer than it is not split: it runs in one pass of its own, said at the first such line (by how much) and "
    "counted in the final report.")


@dataclass
class PrefixReuseOptions:
    """Examples too long for one pass: their shared prefix once, their responses in chunks against its K/V."""

    prefix_reuse: bool = field(default=False, metadata={"help": PREFIX_REUSE_HELP})
    max_tokens_per_pass: str = field(default="auto", metadata={"help": MAX_TOKENS_PER_PASS_HELP})


def check_prefix_reuse(args) -> None:
    """One-line ConfigErrors for the prefix-reuse options (`PrefixReuseOptions`); an int budget is made an int."""
    budget = str(args.max_tokens_per_pass)
    if budget != "auto":
        try:
            args.max_tokens_per_pass = int(budget)
        except ValueError:
            raise ConfigError(f"max_tokens_per_pass={budget!r}: expected 'auto' or a number of tokens") from None
        if args.max_tokens_per_pass < 1:
            raise ConfigError(f"max_tokens_per_pass={budget}: must be positive")
        if not args.prefix_reuse:
            raise ConfigError(f"max_tokens_per_pass={budget} has no effect without prefix_reuse: add --prefix_reuse "
                              "true")
    if args.prefix_reuse and not getattr(args, "prefix_sharing", True):
        raise ConfigError("prefix_reuse=true needs prefix_sharing=true: the prefix is what the responses share")


def resolve_tokens_per_pass(args, model) -> int | None:
    """The budget of one pass with `prefix_reuse` (`max_tokens_per_pass`, or what the device allows for `model`:
    `core.fit.auto_tokens_per_pass`), else None: a batch line over it runs its prefix once and its responses in
    chunks (`core.prefix_reuse`)."""
    if not args.prefix_reuse:
        return None
    from prefixdpo.core.attention.reuse_plan import OVER_BUDGET

    OVER_BUDGET.reset()  # this run's passes over the budget, said once (`reuse_plan.OverBudget`)
    if str(args.max_tokens_per_pass) != "auto":
        return int(args.max_tokens_per_pass)
    import torch

    from prefixdpo.core.fit import auto_tokens_per_pass
    from prefixdpo.core.model_checks import base_model

    half = getattr(args, "bf16", False) or getattr(args, "fp16", False)  # autocast: activations in 2 bytes
    itemsize = 2 if half else torch.finfo(base_model(model).dtype).bits // 8
    budget = auto_tokens_per_pass(model, args.device, itemsize)
    logging.getLogger(__name__).info("prefix_reuse: at most %d tokens per pass (max_tokens_per_pass=auto)", budget)
    return budget


SEQUENCE_PARALLEL_HELP = (
    "Ranks that hold one line between them (Ulysses sequence parallelism, DeepSpeed's all-to-all; `accelerate`'s "
    "sp_size): each rank runs 1/N of the line's tokens outside attention and 1/N of the heads over the whole line "
    "inside it, with prefixdpo's mask on every backend. Launch a multiple of N processes: N x M ranks train M "
    "data-parallel groups (DDP or FSDP2 over all ranks). The model's attention heads and key/value heads must be "
    "multiples of N. Not with prefix_reuse, precompute_ref_log_probs or the MoE load-balancing loss yet.")


@dataclass
class SequenceParallelOptions:
    """One line over several ranks (`core.sequence_parallel`)."""

    sequence_parallel_size: int = field(default=1, metadata={"help": SEQUENCE_PARALLEL_HELP})


def check_sequence_parallel(args) -> None:
    """One-line ConfigErrors for `sequence_parallel_size` and the options it cannot run with yet."""
    size = args.sequence_parallel_size
    if size < 1:
        raise ConfigError(f"sequence_parallel_size={size}: must be >= 1")
    if size == 1:  # whether it divides the launched processes: when the trainer builds the groups
        return
    if getattr(args, "prefix_reuse", False):
        raise ConfigError(f"prefix_reuse=true is not supported with sequence_parallel_size={size} yet: set one of "
                          "them off")
    if getattr(args, "precompute_ref_log_probs", False):
        raise ConfigError(f"precompute_ref_log_probs=True is not supported with sequence_parallel_size={size} yet "
                          "(its table's rows are shared out over every rank): leave it off (the reference runs each "
                          "step)")
    if getattr(args, "packing", False):
        length = args.pack_length
        if str(length) == "auto" and 128 % size:
            raise ConfigError(f"packing with pack_length auto (a multiple of 128) does not split over "
                              f"sequence_parallel_size={size}: set pack_length to a multiple of {size}")
        if str(length) != "auto" and int(length) % size:
            raise ConfigError(f"pack_length={length} is not a multiple of sequence_parallel_size={size}: each rank "
                              "holds an equal share of every line")


@dataclass
class RunSafetyOptions:
    """What a run does with a non-finite step, and with an output_dir that holds another run."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an output_dir that holds another run (checkpoints or a model with another "
                          "fingerprint: model, data or options): its checkpoints are deleted first. Off: refused. "
                          "(The name older TrainingArguments used; transformers 5 dropped it.)"},
    )
    nonfinite: str = field(default="stop", metadata={"help": NONFINITE_HELP, "choices": list(POLICIES)})
    nonfinite_max_consecutive: int = field(default=10, metadata={"help": NONFINITE_MAX_CONSECUTIVE_HELP})


def run_safety(args) -> RunSafetyOptions:
    """The run-safety options of a trainer's config: its own, or their defaults for a config without them (a plain
    TRL config handed to a prefixdpo trainer), read without writing anything onto the user's config."""
    return RunSafetyOptions(**{f.name: getattr(args, f.name, f.default) for f in fields(RunSafetyOptions)})


IGNORE_BIAS_BUFFERS_HELP = (
    "DDP: leave the model's boolean buffers (attention-mask/bias buffers some models register) out of DDP's "
    "buffer broadcast, as TRL's scripts do (the model's _ddp_params_and_buffers_to_ignore; a fix for 'invalid "
    "scalar type' / in-place errors, https://github.com/huggingface/transformers/issues/22482). Only DDP reads it.")


@dataclass
class ScriptArguments:
    """TRL 1.16's `ScriptArguments`, field for field: which dataset, which splits (tests/test_trl_model_config.py
    walks TRL's fields)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Path or name of the dataset to load: a Hub name, a .jsonl/.json/.parquet/.csv file or a "
                          "folder of them (default: the demo data).", "aliases": ["--dataset"]},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Dataset configuration name: the `name` argument of datasets.load_dataset."})
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split to use for training."})
    dataset_test_split: str = field(
        default="test",
        metadata={"help": "Dataset split to use for evaluation, as TRL: read when eval_strategy is not 'no' (the "
                          "held-out metrics are then also printed at the end)."})
    dataset_streaming: bool = field(
        default=False,
        metadata={"help": "TRL: load the dataset in streaming mode. Refused: prefixdpo plans each epoch's "
                          "micro-batches from every example's length (packing, equal micro-batches on every rank, "
                          "the pairs of each step), which needs the whole split."})
    ignore_bias_buffers: bool = field(default=False, metadata={"help": IGNORE_BIAS_BUFFERS_HELP})

    def __post_init__(self) -> None:
        if self.dataset_streaming:
            raise ConfigError(f"dataset_streaming is not supported: {self.streaming_refused()}")

    def streaming_refused(self) -> str:
        """Why this command cannot train on a streamed split (the DPO and reward data pipeline's reason)."""
        from prefixdpo.data.loading import STREAMING_REFUSED

        return STREAMING_REFUSED


@dataclass
class RecordSizeOptions:
    """How big one record of a local file may be: declared once, on `train`, `reward`, `grpo` and `rloo` (and
    `inspect`), after TRL's `ScriptArguments`."""

    max_record_bytes: int = field(default=DEFAULT_MAX_RECORD_BYTES, metadata={"help": MAX_RECORD_BYTES_HELP})

    def __post_init__(self) -> None:
        check_max_record_bytes(self.max_record_bytes)
        parent = getattr(super(), "__post_init__", None)  # ScriptArguments' (the streaming refusal)
        if parent is not None:
            parent()


@dataclass
class DataArguments(RecordSizeOptions, ScriptArguments):
    """TRL's `ScriptArguments` and how records become examples (the rest of `DataOptions` comes from the config)."""

    max_samples: int | None = field(default=None, metadata={"help": "Use only the first N records."})
    pairs_policy: str = field(
        default="best_vs_worst",
        metadata={"help": "Multi-response records: best_vs_worst | best_vs_each | all_pairs."})
    overlong: str = field(
        default="truncate",
        metadata={"help": "Examples with a prompt + response over max_length: truncate or drop."})
    invalid: str = field(default="error", metadata={"help": "Invalid records: error or skip."})


# The `DataOptions` fields `DataArguments` holds under the same names (the lengths come from the config).
RECORD_OPTIONS = ("overlong", "invalid", "pairs_policy", "max_samples", "dataset_config", "max_record_bytes")


def pipeline_options(config, data: DataArguments | None, default: DataArguments, **from_config):
    """The data pipeline's `DataOptions` of a DPO or reward run: `max_length` (and `from_config`, e.g. DPO's
    `truncation_mode`) from the config, the rest from the dataset arguments `data` (None: `default`, the trainer's
    own, which reads no held-out split from a training dataset: evaluation data is given apart)."""
    from prefixdpo.data.prepare import DataOptions

    held_out = eval_split(config, data)
    data = data or default
    return DataOptions(max_length=config.max_length, split=data.dataset_train_split, eval_split=held_out,
                       **{name: getattr(data, name) for name in RECORD_OPTIONS}, **from_config)


def eval_split(config, data: ScriptArguments | None) -> str | None:
    """The held-out split a command reads, as TRL's scripts choose it: `dataset_test_split` when `eval_strategy` is
    not 'no', else none; none without dataset arguments (the Python API gives its evaluation data apart)."""
    return data.dataset_test_split if data is not None and config.eval_strategy != "no" else None


def script_options_without_effect(config, data: ScriptArguments) -> list[str]:
    """TRL's script options set to something this run does not use, one line each (accepted, as TRL does)."""
    lines = []
    if data.dataset_config is not None and data.dataset_name is not None and is_local(data.dataset_name):
        lines.append(f"dataset_config={data.dataset_config!r} has no effect: {data.dataset_name} is a local file or "
                     "folder (a configuration names a subset of a Hub dataset)")
    if data.dataset_test_split != "test" and eval_split(config, data) is None:
        lines.append(f"dataset_test_split={data.dataset_test_split!r} has no effect with eval_strategy 'no' (as "
                     "TRL): set --eval_strategy steps or epoch to evaluate on it")
    if data.ignore_bias_buffers and not runs_ddp(config):
        lines.append("ignore_bias_buffers has no effect: only DDP reads it, and this run "
                     f"{'is one process' if config.world_size == 1 else 'is sharded by FSDP or DeepSpeed'}")
    return lines


def is_local(dataset_name: str) -> bool:
    return os.path.exists(os.path.expanduser(dataset_name))


def runs_ddp(config) -> bool:
    """Whether Trainer wraps the model in DDP: several processes, neither FSDP nor DeepSpeed."""
    return config.world_size > 1 and not config.fsdp and not config.deepspeed


def resolve_before_trainer_args(args) -> None:
    """TRL's resolutions, applied before `TrainingArguments.__post_init__` sees the options."""
    if args.bf16 is None:
        # TRL resolves it to `not fp16`, which TrainingArguments then refuses on a machine without bf16
        # (a CPU unless use_cpu): here it is on only where the device has bf16, so a CPU run is fp32.
        args.bf16 = not args.fp16 and device_has_bf16(args.use_cpu)
    # gradient_checkpointing* are TRL's names; transformers >= 5.2x calls them deprecated aliases of
    # activation_checkpointing* and warns on every config unless the new names are set (5.17 has only the old ones).
    if not hasattr(args, "activation_checkpointing"):
        if not args.gradient_checkpointing_kwargs:  # non-reentrant: works with frozen inputs (LoRA) and our masks
            args.gradient_checkpointing_kwargs = {"use_reentrant": False}
    else:
        if args.activation_checkpointing is None:
            args.activation_checkpointing = args.gradient_checkpointing
        if not args.activation_checkpointing_kwargs:
            args.activation_checkpointing_kwargs = args.gradient_checkpointing_kwargs or {"use_reentrant": False}
        args.gradient_checkpointing_kwargs = args.activation_checkpointing_kwargs
    if args.ddp_find_unused_parameters is None:
        # Every parameter is used in every step; Trainer's None would search when not checkpointing.
        args.ddp_find_unused_parameters = False
    join_cpu_processes(args)


def check_attention_and_pack_length(args) -> None:
    """`attention` one of ours and `pack_length` "auto" or a positive int (set to the int), else a `ConfigError`."""
    if args.attention not in BACKENDS:
        raise ConfigError(f"attention={args.attention!r}: choose one of {', '.join(BACKENDS)}")
    if str(args.pack_length) != "auto":
        try:
            args.pack_length = int(args.pack_length)
        except ValueError:
            raise ConfigError(f"pack_length={args.pack_length!r}: expected 'auto' or a positive integer") from None
        if args.pack_length <= 0:
            raise ConfigError(f"pack_length={args.pack_length}: must be positive")


def check_shared_options(args) -> None:
    """The shared options' checks, after `TrainingArguments.__post_init__`: one-line `ConfigError`s."""
    args.pad_to_multiple_of = pad_multiple(args.pad_to_multiple_of, args.use_cpu)
    if args.model_init_kwargs is not None and not isinstance(args.model_init_kwargs, dict):
        raise ConfigError(f"model_init_kwargs={args.model_init_kwargs!r}: expected a JSON object, e.g. "
                          '\'{"dtype": "bfloat16"}\'')
    check_attention_and_pack_length(args)
    check_sequence_parallel(args)
    if str(args.pack_length) != "auto":
        if not args.packing:
            raise ConfigError(f"pack_length={args.pack_length} has no effect without packing: add --packing true, "
                              "or leave pack_length out")
    if args.group_by_prompt and not args.prefix_sharing:
        raise ConfigError("group_by_prompt=true needs prefix_sharing=true: a group is one prefix-shared row")
    if args.prefix_tree and not (args.prefix_sharing and args.packing):
        raise ConfigError("prefix_tree=true needs prefix_sharing=true and packing=true: a trie shares tokens across "
                          "the records of one packed line")
    check_prefix_reuse(args)
    if args.prefix_reuse and args.packing:
        raise ConfigError("prefix_reuse=true runs examples unpacked (a packed line's examples share no prefix to run "
                          "once): set packing false")
    check_nonfinite_options(args.nonfinite, args.nonfinite_max_consecutive)
    if args.train_sampling_strategy not in ("random", "sequential"):
        # Trainer's samplers are replaced by our micro-batch plan; packing is how we group by length.
        raise ConfigError(f"train_sampling_strategy={args.train_sampling_strategy!r}: prefixdpo supports "
                          "'random' (a seeded shuffle per epoch) and 'sequential' (file order); --packing "
                          "groups rows by length")


def changed_options(args) -> set[str]:
    """The names of the fields of `args` set to something other than their default."""
    values = vars(args)
    return {f.name for f in fields(args) if f.name in values and values[f.name] != f.default}


def state_options_without_effect(lines: list[str]) -> None:
    """TRL's options that change nothing in this run are accepted as TRL accepts them (a TRL YAML runs
    unchanged), with one warning line each."""
    for line in lines:
        logging.getLogger(__name__).warning("%s", line)


def join_cpu_processes(args) -> None:
    """Several processes (torchrun / accelerate launch) on a machine without an accelerator train together on the
    CPU (gloo). transformers sets that up only with use_cpu; without it every process would run as a separate
    single-process run (each its own rank 0), all writing the same output_dir."""
    import torch

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    if launched and not accelerator and not args.use_cpu:
        args.use_cpu = True
        args.ddp_backend = args.ddp_backend or "gloo"


def device_has_bf16(use_cpu: bool) -> bool:
    """Whether the training device computes in bf16 natively (never the CPU: ATen emulates it there, slowly)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return not use_cpu and (is_torch_bf16_gpu_available() or is_torch_xla_available())


def pad_multiple(value: int | str | None, use_cpu: bool) -> int | None:
    """pad_to_multiple_of as TRL resolves it: 'auto' is 128 on Neuron (it compiles once per shape), else None."""
    if value == "auto":
        from transformers.utils import is_torch_neuron_available

        return 128 if not use_cpu and is_torch_neuron_available() else None
    if isinstance(value, str):  # the command line gives text
        if value.lower() in ("none", "null"):
            return None
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"pad_to_multiple_of={value!r}: expected a positive integer, 'auto' or none") from None
    if value is not None and value < 1:
        raise ConfigError(f"pad_to_multiple_of={value}: must be >= 1")
    return value
