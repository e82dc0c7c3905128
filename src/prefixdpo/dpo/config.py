"""`PrefixDPOConfig`: training options; every field of TRL 1.16's `DPOConfig` with its name, type, default
and meaning (tests/test_trl_config.py walks TRL's fields and lists the few justified exceptions).

It extends `transformers.TrainingArguments`, so every Trainer option (learning rate, schedules,
gradient accumulation, bf16, checkpointing, `report_to`, DDP/FSDP/DeepSpeed) works unchanged, with
TRL's DPO defaults where TRL changes them (learning_rate 1e-6, logging_steps 10, gradient checkpointing
on, bf16 where the device has it). TRL options that prefix sharing makes moot (`padding_free`) are
accepted and say so in their help. The prefix-sharing options are ours: `prefix_sharing`, `packing`, `pack_length`, `attention`,
`logprob_chunk_size`, `ref_cache_dir`; so are `nonfinite` and `nonfinite_max_consecutive` (a NaN/inf step).

`parse_train_args(["config.yaml", "--beta", "0.05"])` reads a YAML file and applies command-line
overrides on top of it, returning the config plus the model and dataset options (`TrainArgumentParser`).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_origin, get_type_hints

from transformers import TrainingArguments

from prefixdpo.core.attention.backends import BACKENDS
from prefixdpo.errors import ConfigError, UserError
from prefixdpo.training.nonfinite import NONFINITE_HELP, NONFINITE_MAX_CONSECUTIVE_HELP, POLICIES, check_nonfinite_options
from prefixdpo.dpo.loss_table import (
    LossParams,
    canonical_loss_types,
    check_loss_options,
    known_loss_names,
    losses_reading,
    needs_reference,
    resolve_losses,
)
from prefixdpo.dpo.tr_dpo import check_tr_dpo_options

ATTENTION_CHOICES = BACKENDS


@dataclass
class PrefixDPOConfig(TrainingArguments):
    """Options of `PrefixDPOTrainer` (TRL `DPOConfig` names + prefix-sharing options + TrainingArguments)."""

    # ---- TrainingArguments defaults that TRL's DPOConfig changes (TRL's defaults) ----
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (TRL's DPO default)."})
    logging_steps: float = field(
        default=10, metadata={"help": "Log every N optimizer steps (a float < 1: that fraction of all steps)."}
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={"help": "Recompute activations in the backward pass to save memory (TRL's default: on; ~20%% slower). "
                          "Same as activation_checkpointing, which wins where both are set."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision. Not set (TRL's default): on where the device supports bf16 and fp16 "
                          "is off, so on CUDA (Ampere+) / XPU / NPU / TPU; off on CPU (fp32)."},
    )
    # ---- TrainingArguments fields whose default is TRL's but whose effect here differs ----
    remove_unused_columns: bool = field(
        default=True,
        metadata={"help": "Accepted, no effect: records' prompt/chosen/rejected (or completions) fields are read and "
                          "any other column is ignored; batches are built by prefixdpo, not by Trainer."},
    )
    # Our head path runs outside the DDP-wrapped forward; a search for unused parameters would mark the
    # LM head unused and then see its gradient arrive twice. Every parameter is used in every step.
    ddp_find_unused_parameters: bool | None = field(
        default=None,
        metadata={"help": "DDP's find_unused_parameters. Not set: False (every parameter is used in every step)."},
    )
    # ---- ours ----
    output_dir: str | None = field(default="prefixdpo-output", metadata={"help": "Where checkpoints and the model go."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an output_dir that holds another run (checkpoints or a model with another "
                          "fingerprint: model, data or options): its checkpoints are deleted first. Off: refused. "
                          "(The name older TrainingArguments used; transformers 5 dropped it.)"},
    )
    report_to: None | str | list[str] = field(
        default="none", metadata={"help": "Integrations to report to (tensorboard, wandb, trackio, ...; 'none')."}
    )

    # ---- TRL DPOConfig names ----
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for AutoModelForCausalLM.from_pretrained when the model is given by name "
                          "or path (as TRL): dtype 'float32' (default) / 'bfloat16' / 'float16' / 'auto', "
                          "attn_implementation, revision, ... A JSON object on the command line."},
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "Weight of the Mixture-of-Experts load-balancing loss added to the training loss; not set: "
                          "the model config's own value; 0.0: off. Refused for a model that is not MoE."},
    )
    dataset_num_proc: int | None = field(
        default=None,
        metadata={"help": "TRL's processes for dataset.map. Accepted, no effect: prefixdpo tokenizes records in "
                          "batched tokenizer calls in one process (fast tokenizers use their own threads)."},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "TRL: flatten the batch into one sequence without padding. Accepted, no effect: prefix-shared "
                          "rows never pad inside a line; --packing is prefixdpo's padding-free layout (several "
                          "examples per line, each attending only to itself)."},
    )
    use_weighting: bool = field(
        default=False,
        metadata={"help": "WPO (https://huggingface.co/papers/2406.11827): weight each pair by the policy's "
                          "length-normalised sequence probabilities, as TRL."},
    )
    ld_alpha: float | None = field(
        default=None,
        metadata={"help": "LD-DPO alpha in [0, 1]: log-prob tokens of the longer response beyond the shorter one's "
                          "length are weighted by alpha (1.0: plain DPO; 0.0: masked). Not set: no weighting."},
    )
    activation_offloading: bool = field(
        default=False, metadata={"help": "Offload activations to CPU memory during the forward (CUDA only), as TRL."}
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={"help": "TR-DPO (https://huggingface.co/papers/2404.09656): every ref_model_sync_steps steps set "
                          "ref = alpha * policy + (1 - alpha) * ref. Not with precompute_ref_log_probs."},
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "TR-DPO alpha: weight of the policy in the reference update (sync_ref_model)."}
    )
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "TR-DPO tau: optimizer steps between reference updates (sync_ref_model)."}
    )
    pad_token: str | None = field(
        default=None,
        metadata={"help": "Deprecated in TRL (set tokenizer.pad_token). Accepted, no effect: padding is masked out "
                          "and never a target, so the pad token cannot change a result."},
    )
    beta: float = field(default=0.1, metadata={"help": "DPO beta (IPO's tau, SimPO's beta)."})
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": f"Loss type(s), combined with loss_weights. One or more of {known_loss_names()}."},
    )
    loss_weights: list[float] | None = field(default=None, metadata={"help": "One weight per loss_type (default 1 each)."})
    label_smoothing: float = field(default=0.0, metadata={"help": "cDPO/robust/EXO epsilon."})
    f_divergence_type: str = field(default="reverse_kl", metadata={"help": "f-DPO divergence."})
    f_alpha_divergence_coef: float = field(default=0.5, metadata={"help": "alpha of the alpha-divergence."})
    discopop_tau: float = field(default=0.05, metadata={"help": "DiscoPOP temperature."})
    simpo_gamma: float = field(default=0.5, metadata={"help": "SimPO target reward margin (TRL CPOConfig name)."})
    orpo_alpha: float = field(default=0.1, metadata={"help": "ORPO lambda weighting the odds-ratio term."})
    rpo_alpha: float | None = field(default=None, metadata={"help": "RPO: adds the chosen NLL ('sft') with this weight."})
    max_length: int | None = field(
        default=1024,
        metadata={"help": "Max tokens of each prompt + response sequence, as TRL (the prefix-shared row may be longer); "
                          "None = no limit."},
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={"help": "Sequences over max_length: keep_start (cut the response end; drop examples whose prompt "
                          "fills max_length) or keep_end (cut the prompt start), as TRL.",
                  "choices": ["keep_end", "keep_start"]},
    )
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "Compute reference log-probs once before training, cached on disk."}
    )
    precompute_ref_batch_size: int | None = field(default=None, metadata={"help": "Examples per precompute batch."})
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={"help": "Pad unpacked lines to a multiple of this; 'auto' (TRL's default): 128 on Neuron (one "
                          "compilation per shape), no padding elsewhere."},
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in policy and reference."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow models with custom code (off unless asked)."})

    # ---- prefix sharing ----
    prefix_sharing: bool = field(default=True, metadata={"help": "Prompt once + all responses in one row."})
    packing: bool = field(default=False, metadata={"help": "Pack several rows per line (per_device_train_batch_size = lines)."})
    pack_length: str = field(default="auto", metadata={"help": "Packed line length: 'auto' or an int."})
    attention: str = field(default="auto", metadata={"help": "Attention backend: auto (flex on CUDA, sdpa else), sdpa, flex, segmented (SDPA over allowed blocks only; faster on CPU for long packed lines), varlen (FlashAttention varlen over allowed blocks; CUDA, bf16/fp16)."})
    logprob_chunk_size: int = field(default=1024, metadata={"help": "Response tokens per LM-head chunk."})
    ref_cache_dir: str | None = field(
        default=None, metadata={"help": "Cache of precomputed reference log-probs (default ~/.cache/prefixdpo/ref_logps)."}
    )
    # ---- a run that survives ----
    nonfinite: str = field(default="stop", metadata={"help": NONFINITE_HELP, "choices": list(POLICIES)})
    nonfinite_max_consecutive: int = field(default=10, metadata={"help": NONFINITE_MAX_CONSECUTIVE_HELP})

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs"]  # JSON text -> dict

    def __post_init__(self) -> None:
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        self.loss_type = list(self.loss_type)
        if self.bf16 is None:
            # TRL resolves it to `not fp16`, which TrainingArguments then refuses on a machine without bf16
            # (a CPU unless use_cpu): here it is on only where the device has bf16, so a CPU run is fp32.
            self.bf16 = not self.fp16 and _device_has_bf16(self.use_cpu)
        # gradient_checkpointing* are TRL's names; transformers calls them deprecated aliases of
        # activation_checkpointing* and warns on every config unless the new names are set.
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing
        if self.activation_checkpointing_kwargs is None and self.gradient_checkpointing_kwargs is not None:
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        if self.ddp_find_unused_parameters is None:
            self.ddp_find_unused_parameters = False  # see the field: Trainer's None would search when not checkpointing
        join_cpu_processes(self)
        super().__post_init__()
        self.pad_to_multiple_of = _pad_multiple(self.pad_to_multiple_of, self.use_cpu)
        if self.model_init_kwargs is not None and not isinstance(self.model_init_kwargs, dict):
            raise ConfigError(f"model_init_kwargs={self.model_init_kwargs!r}: expected a JSON object, e.g. "
                              '\'{"dtype": "bfloat16"}\'')
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ConfigError(f"ld_alpha={self.ld_alpha}: must be in [0, 1]")
        check_tr_dpo_options(self)
        if not self.activation_checkpointing_kwargs:
            # Non-reentrant checkpointing works with frozen inputs (LoRA) and with our custom mask.
            self.activation_checkpointing_kwargs = {"use_reentrant": False}
            self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs
        resolve_losses(self.loss_type, self.loss_weights)  # names and weights: the loss table's one check
        if self.attention not in ATTENTION_CHOICES:
            raise ConfigError(f"attention={self.attention!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
        if str(self.pack_length) != "auto":
            try:
                self.pack_length = int(self.pack_length)
            except ValueError:
                raise ConfigError(f"pack_length={self.pack_length!r}: expected 'auto' or a positive integer") from None
            if self.pack_length <= 0:
                raise ConfigError(f"pack_length={self.pack_length}: must be positive")
        check_nonfinite_options(self.nonfinite, self.nonfinite_max_consecutive)
        if self.logprob_chunk_size < 1:
            raise ConfigError(f"logprob_chunk_size={self.logprob_chunk_size}: must be >= 1")
        if self.beta <= 0:
            raise ConfigError(f"beta={self.beta}: must be positive")
        if self.train_sampling_strategy not in ("random", "sequential"):
            # Trainer's samplers are replaced by our micro-batch plan; packing is how we group by length.
            raise ConfigError(f"train_sampling_strategy={self.train_sampling_strategy!r}: prefixdpo supports "
                              "'random' (a seeded shuffle per epoch) and 'sequential' (file order); --packing "
                              "groups rows by length")
        check_loss_options(self.loss_types, self.loss_params())  # f-divergence and WPO defined for these losses
        refuse_or_state_options_without_effect(self)

    # ---- derived ----
    @property
    def loss_types(self) -> list[str]:
        """Loss names including RPO's NLL term when rpo_alpha is set."""
        names = list(self.loss_type)
        if self.rpo_alpha is not None and "sft" not in names:
            names.append("sft")
        return names

    @property
    def loss_weight_list(self) -> list[float]:
        weights = list(self.loss_weights) if self.loss_weights is not None else [1.0] * len(self.loss_type)
        if self.rpo_alpha is not None and "sft" not in self.loss_type:
            weights.append(float(self.rpo_alpha))
        return weights

    @property
    def needs_reference(self) -> bool:
        return needs_reference(self.loss_types)

    def loss_params(self) -> LossParams:
        return LossParams(
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            simpo_gamma=self.simpo_gamma,
            orpo_alpha=self.orpo_alpha,
            discopop_tau=self.discopop_tau,
            f_divergence_type=self.f_divergence_type,
            f_alpha_divergence_coef=self.f_alpha_divergence_coef,
            use_weighting=self.use_weighting,
            ld_alpha=self.ld_alpha,
        )

    def resolved_ref_cache_dir(self) -> str:
        if self.ref_cache_dir:
            return self.ref_cache_dir
        base = os.environ.get("PREFIXDPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "prefixdpo")
        return os.path.join(base, "ref_logps")


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


def refuse_or_state_options_without_effect(config) -> None:
    """Options set to a value that changes nothing in this run. Ours are refused in one line (`ConfigError`):
    the user meant something that would not happen. TRL's are accepted as TRL accepts them, with one warning
    line each, so a TRL DPO YAML runs unchanged; so is `ref_cache_dir`, which only names a place. Fields the
    config class lacks are skipped (the reward config shares the packing options only)."""
    values = vars(config)
    changed = {f.name for f in fields(config) if f.name in values and values[f.name] != f.default}
    if "pack_length" in values and str(config.pack_length) != "auto" and not config.packing:
        raise ConfigError(f"pack_length={config.pack_length} has no effect without packing: add --packing true, "
                          "or leave pack_length out")
    precompute = values.get("precompute_ref_log_probs", False)
    if "loss_type" not in values:
        return
    # Which losses read an option is the loss table's; which options are checked here is a choice: ours are
    # refused, TRL's stated (TRL accepts label_smoothing & co. with any loss silently, so do we).
    losses = set(canonical_loss_types(config.loss_types))
    for option in ("simpo_gamma", "orpo_alpha"):
        readers = losses_reading(option)
        if option in changed and not losses & set(readers):
            raise ConfigError(f"{option}={values[option]} has no effect: it is a parameter of loss_type "
                              f"{' '.join(readers)}, not of {' '.join(config.loss_type)}")
    stated = []  # TRL's options, and where a setting only names a place: accepted, said once
    if values.get("ref_cache_dir") and not precompute:  # a base config may set it for every run
        stated.append("ref_cache_dir has no effect without precompute_ref_log_probs")
    if values.get("precompute_ref_batch_size") is not None and not precompute:
        stated.append(f"precompute_ref_batch_size={config.precompute_ref_batch_size} has no effect without "
                      "precompute_ref_log_probs")
    if precompute and not config.needs_reference:
        stated.append(f"precompute_ref_log_probs has no effect: loss_type {' '.join(config.loss_type)} uses no "
                      "reference model")
    discopop = losses_reading("discopop_tau")
    if "discopop_tau" in changed and not losses & set(discopop):
        stated.append(f"discopop_tau={config.discopop_tau} has no effect: loss_type is not {' or '.join(discopop)}")
    for option in ("ref_model_mixup_alpha", "ref_model_sync_steps"):
        if option in changed and not config.sync_ref_model:
            stated.append(f"{option}={values[option]} has no effect without sync_ref_model")
    for line in stated:
        logging.getLogger(__name__).warning("%s", line)


def _device_has_bf16(use_cpu: bool) -> bool:
    """Whether the training device computes in bf16 natively (never the CPU: ATen emulates it there, slowly)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return not use_cpu and (is_torch_bf16_gpu_available() or is_torch_xla_available())


def _pad_multiple(value: int | str | None, use_cpu: bool) -> int | None:
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


@dataclass
class ModelArguments:
    """Which model to train and how (LoRA)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "HF model name or local path (default: the demo model).", "aliases": ["--model"]}
    )
    ref_model_name_or_path: str | None = field(default=None, metadata={"help": "Separate reference model (default: a frozen copy)."})
    dtype: str = field(default="float32", metadata={"help": "Weights dtype as TRL's ModelConfig: float32 (default; "
                                                        "--bf16 then autocasts), bfloat16, float16, or auto (the "
                                                        "checkpoint's own)."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 = full fine-tuning."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "Modules to adapt (default: all linear)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "QLoRA (CUDA + bitsandbytes only)."})

    def __post_init__(self) -> None:
        # LoRA's other options without a rank would be silently ignored: full fine-tuning would run instead
        lora_options = ("lora_alpha", "lora_dropout", "lora_target_modules")
        unused = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                  if f.name in lora_options and getattr(self, f.name) != f.default]
        if unused and self.lora_r <= 0:
            raise ConfigError(f"{', '.join(unused)} has no effect without LoRA (lora_r={self.lora_r}): set "
                              "--lora_r, e.g. --lora_r 16, or leave the LoRA options out")

    def peft_config(self):
        """A `peft.LoraConfig` when lora_r > 0, else None."""
        if self.lora_r <= 0:
            return None
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.lora_target_modules or "all-linear",
            task_type="CAUSAL_LM",
        )


@dataclass
class DataArguments:
    """Which dataset, and how records become examples (the rest of `DataOptions` comes from the config)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "HF dataset name, or a .jsonl/.json/.parquet path (default: the demo data).", "aliases": ["--dataset"]},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split (TRL name)."})
    dataset_test_split: str | None = field(default=None, metadata={"help": "Evaluation split (TRL name)."})
    max_samples: int | None = field(default=None, metadata={"help": "Use only the first N records."})
    pairs_policy: str = field(default="best_vs_worst", metadata={"help": "Multi-response records: best_vs_worst | best_vs_each | all_pairs."})
    overlong: str = field(default="truncate", metadata={"help": "Examples with a prompt + response over max_length: truncate or drop."})
    invalid: str = field(default="error", metadata={"help": "Invalid records: error or skip."})


def data_options(config: PrefixDPOConfig, data: DataArguments | None = None):
    """The data pipeline's `DataOptions` from the config (lengths, truncation) and dataset arguments."""
    from prefixdpo.data.prepare import DataOptions

    data = data or DataArguments()
    return DataOptions(
        max_length=config.max_length,
        truncation_mode=config.truncation_mode,
        overlong=data.overlong,
        invalid=data.invalid,
        pairs_policy=data.pairs_policy,
        max_samples=data.max_samples,
        split=data.dataset_train_split,
        eval_split=data.dataset_test_split,
        dataset_config=data.dataset_config,
    )


def _json_object(text: str) -> dict | None:
    """A dict option's command-line value: a JSON object (`'{"rope": true}'`) or none."""
    if text.lower() in ("none", "null"):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


@functools.cache
def _train_argument_parser() -> type:
    # TRL is imported only when options are parsed: training through the Python API (and the GPU check, on a
    # machine without TRL or `datasets`) must not need it.
    from trl import TrlParser

    class TrainArgumentParser(TrlParser):
        """The options of `prefixdpo train`: every field of `PrefixDPOConfig`, `ModelArguments`, `DataArguments`.

        TRL's `TrlParser` (an `HfArgumentParser` whose `T | None` options also take `none`, e.g.
        `--max_length none`), plus:
        - every boolean option X takes `--X`, `--X true|false` and `--no_X` (HfArgumentParser adds `--no_X`
          only where X defaults to True, and `--X` alone only where the default is not None);
        - no abbreviations: a misspelt option is an error, never a silent match of a longer one;
        - every parse error raises `ConfigError` (one line) instead of printing usage and exiting.
        Options are spelled with underscores or dashes (`--lora_r 8` == `--lora-r 8`).
        """

        def __init__(self, **kwargs):
            super().__init__((PrefixDPOConfig, ModelArguments, DataArguments), allow_abbrev=False, **kwargs)
            for dc in self.dataclass_types:
                hints = get_type_hints(dc)
                for f in fields(dc):
                    hint = hints[f.name]
                    if f.init and (hint is bool or bool in get_args(hint)):
                        self._complete_bool_option(f.name)
                    elif f.init and str not in get_args(hint) and dict in map(get_origin, (hint, *get_args(hint))):
                        # HfArgumentParser calls dict(text), which no text passes; `dict | str` fields take JSON already
                        self._option_string_actions[f"--{f.name}"].type = _json_object
            self.configured: set[str] = set()  # options the config file sets

        def _complete_bool_option(self, name: str) -> None:
            action = self._option_string_actions[f"--{name}"]
            action.nargs, action.const = "?", True
            if f"--no_{name}" not in self._option_string_actions:
                self.add_argument(f"--no_{name}", f"--no-{name.replace('_', '-')}", action="store_false",
                                  dest=name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

        def error(self, message: str):
            raise ConfigError(message)

        def read_config_file(self, path: str) -> None:
            """YAML (or JSON) `option: value` pairs become the defaults that command-line options override."""
            import yaml

            try:
                with open(path, encoding="utf-8") as fh:
                    values = yaml.safe_load(fh) or {}
            except FileNotFoundError:
                raise ConfigError(f"config file not found: {path}") from None
            except yaml.YAMLError as err:
                raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: expected a mapping of option: value at the top level")
            defaults, unknown = {}, []
            for key, value in values.items():
                action = self._option_string_actions.get(f"--{key}")
                if action is None or action.nargs == 0:  # not an option, or a flag like --no_packing / --help
                    unknown.append(str(key))
                    continue
                if action.nargs == "+" and not isinstance(value, list):
                    value = [value]  # `loss_type: sigmoid` is the one-item list
                defaults[action.dest] = value
            if unknown:
                raise ConfigError(f"{path}: unknown option(s) {', '.join(unknown)}")
            self.set_defaults_with_config(**defaults)
            self.configured |= set(defaults)

        def names_model_or_dataset(self, argv: list[str]) -> bool:
            """Whether the config file or `argv` sets the model or the dataset."""
            namespace, _ = self.parse_known_args(argv)
            return namespace.model_name_or_path is not None or namespace.dataset_name is not None

        def parse(self, argv: list[str]) -> tuple[PrefixDPOConfig, ModelArguments, DataArguments]:
            """Command-line options over the defaults; unknown options and bad values raise `ConfigError`."""
            namespace, rest = self.parse_known_args(argv)
            options = [a.split("=", 1)[0] for a in rest if a.startswith("--")]
            if options:
                raise ConfigError(f"unknown option(s) {', '.join(options)} (see prefixdpo train --help)")
            if rest:
                raise ConfigError(f"unexpected argument(s) {' '.join(rest)}: only the first argument may be a config file")
            try:
                config, model_args, data_args = self.parse_dict(vars(namespace))
            except UserError:
                raise
            except ValueError as err:  # TrainingArguments' own checks of option values and combinations
                raise ConfigError(str(err)) from err
            return config, model_args, data_args

    return TrainArgumentParser


def __getattr__(name: str):
    if name == "TrainArgumentParser":  # PEP 562: built on first use (see `_train_argument_parser`)
        return _train_argument_parser()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_train_args(
    argv: list[str] | None = None, demo_defaults: dict[str, str] | None = None, **parser_kwargs
) -> tuple[PrefixDPOConfig, ModelArguments, DataArguments]:
    """Parse `[config.yaml] [--option value ...]`: command-line options override the config file's values.

    demo_defaults: option -> value (as typed on the command line), used where neither the config file nor
    the command line sets the option, and only when neither names a model or a dataset (the embedded demo).
    parser_kwargs: passed to `TrainArgumentParser` (usage, description of the help).
    """
    argv = list(argv or [])
    parser = _train_argument_parser()(**parser_kwargs)
    if argv and not argv[0].startswith("-"):
        parser.read_config_file(argv.pop(0))
    if demo_defaults and not parser.names_model_or_dataset(argv):
        parser.set_defaults(**{k: v for k, v in demo_defaults.items() if k not in parser.configured})
    return parser.parse(argv)
