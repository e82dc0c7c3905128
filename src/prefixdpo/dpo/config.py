"""`PrefixDPOConfig`: training options; every field of TRL 1.16's `DPOConfig` with its name, type, default
and meaning (tests/test_trl_config.py walks TRL's fields and lists the few justified exceptions).

It extends `transformers.TrainingArguments`, so every Trainer option (learning rate, schedules,
gradient accumulation, bf16, checkpointing, `report_to`, DDP/FSDP/DeepSpeed) works unchanged, with
TRL's DPO defaults where TRL changes them (learning_rate 1e-6, logging_steps 10, gradient checkpointing
on, bf16 where the device has it). TRL options that prefix sharing makes moot (`padding_free`) are
accepted and say so in their help. The prefix-sharing options are ours: `prefix_sharing`, `packing`, `pack_length`, `attention`,
`logprob_chunk_size`, `ref_cache_dir`; so are `nonfinite` and `nonfinite_max_consecutive` (a NaN/inf step).

The command line reads these with `prefixdpo.commands.options.parse_options(DPO_OPTIONS, argv)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

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
from prefixdpo.errors import ConfigError
from prefixdpo.training.model_options import ModelArguments
from prefixdpo.training.options import (
    DataArguments, PrefixReuseOptions, PrefixSharingOptions, RunSafetyOptions, SequenceParallelOptions, changed_options,
    check_shared_options, pipeline_options, resolve_before_trainer_args, state_options_without_effect,
)


def _loss_option(name: str, help_text: str):
    """The field of loss option `name`: its default is `LossParams`' (the one place a loss default is written)."""
    return field(default=getattr(LossParams, name), metadata={"help": help_text})


@dataclass
class PrefixDPOConfig(PrefixSharingOptions, PrefixReuseOptions, RunSafetyOptions, SequenceParallelOptions,
                      TrainingArguments):
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
    use_weighting: bool = _loss_option(
        "use_weighting", "WPO (https://huggingface.co/papers/2406.11827): weight each pair by the policy's "
                         "length-normalised sequence probabilities, as TRL.")
    ld_alpha: float | None = _loss_option(
        "ld_alpha", "LD-DPO alpha in [0, 1]: log-prob tokens of the longer response beyond the shorter one's "
                    "length are weighted by alpha (1.0: plain DPO; 0.0: masked). Not set: no weighting.")
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
    beta: float = _loss_option("beta", "DPO beta (IPO's tau, SimPO's beta).")
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": f"Loss type(s), combined with loss_weights. One or more of {known_loss_names()}."},
    )
    loss_weights: list[float] | None = field(default=None, metadata={"help": "One weight per loss_type (default 1 each)."})
    label_smoothing: float = _loss_option("label_smoothing", "cDPO/robust/EXO epsilon.")
    f_divergence_type: str = _loss_option("f_divergence_type", "f-DPO divergence.")
    f_alpha_divergence_coef: float = _loss_option("f_alpha_divergence_coef", "alpha of the alpha-divergence.")
    discopop_tau: float = _loss_option("discopop_tau", "DiscoPOP temperature.")
    simpo_gamma: float = _loss_option("simpo_gamma", "SimPO target reward margin (TRL CPOConfig name).")
    orpo_alpha: float = _loss_option("orpo_alpha", "ORPO lambda weighting the odds-ratio term.")
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

    # ---- prefix sharing (beside `PrefixSharingOptions`) ----
    logprob_chunk_size: int = field(default=1024, metadata={"help": "Response tokens per LM-head chunk."})
    ref_cache_dir: str | None = field(
        default=None, metadata={"help": "Cache of precomputed reference log-probs (default ~/.cache/prefixdpo/ref_logps)."}
    )

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs"]  # JSON text -> dict

    def __post_init__(self) -> None:
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        self.loss_type = list(self.loss_type)
        resolve_before_trainer_args(self)
        super().__post_init__()
        check_shared_options(self)
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ConfigError(f"ld_alpha={self.ld_alpha}: must be in [0, 1]")
        check_tr_dpo_options(self)
        resolve_losses(self.loss_type, self.loss_weights)  # names and weights: the loss table's one check
        if self.logprob_chunk_size < 1:
            raise ConfigError(f"logprob_chunk_size={self.logprob_chunk_size}: must be >= 1")
        if self.beta <= 0:
            raise ConfigError(f"beta={self.beta}: must be positive")
        check_loss_options(self.loss_types, LossParams.from_config(self))  # f-divergence, WPO defined for them
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

    @property
    def precompute_batch_size(self) -> int:
        """Examples per batch of the reference precompute: `precompute_ref_batch_size`, else the eval batch size."""
        return self.precompute_ref_batch_size or self.per_device_eval_batch_size

    def resolved_ref_cache_dir(self) -> str:
        if self.ref_cache_dir:
            return self.ref_cache_dir
        base = os.environ.get("PREFIXDPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "prefixdpo")
        return os.path.join(base, "ref_logps")


def refuse_or_state_options_without_effect(config) -> None:
    """DPO options set to a value that changes nothing in this run. Ours are refused in one line (`ConfigError`):
    the user meant something that would not happen. TRL's are accepted as TRL accepts them, with one warning
    line each, so a TRL DPO YAML runs unchanged; so is `ref_cache_dir`, which only names a place."""
    values = vars(config)
    changed = changed_options(config)
    precompute = config.precompute_ref_log_probs
    # Which losses read an option is the loss table's; which options are checked here is a choice: ours are
    # refused, TRL's stated (TRL accepts label_smoothing & co. with any loss silently, so do we).
    losses = set(canonical_loss_types(config.loss_types))
    for option in ("simpo_gamma", "orpo_alpha"):
        readers = losses_reading(option)
        if option in changed and not losses & set(readers):
            raise ConfigError(f"{option}={values[option]} has no effect: it is a parameter of loss_type "
                              f"{' '.join(readers)}, not of {' '.join(config.loss_type)}")
    stated = []  # TRL's options, and where a setting only names a place: accepted, said once
    if config.ref_cache_dir and not precompute:  # a base config may set it for every run
        stated.append("ref_cache_dir has no effect without precompute_ref_log_probs")
    if config.precompute_ref_batch_size is not None and not precompute:
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
    state_options_without_effect(stated)


@dataclass
class DPOModelArguments(ModelArguments):
    """TRL's `ModelConfig` (`training.model_options.ModelArguments`) and the separate reference model of DPO."""

    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Separate reference model, loaded with the model's from_pretrained arguments (revision, "
                          "dtype, attn_implementation, quantization, model_init_kwargs) as TRL builds its reference. "
                          "Not set: a frozen copy of the model (with --use_peft: the model with its adapter off)."})


def data_options(config: PrefixDPOConfig, data: DataArguments | None = None):
    """The data pipeline's `DataOptions` from the config (lengths, truncation) and dataset arguments (None: the
    trainer's own, which reads no held-out split from a training dataset: evaluation data is given apart)."""
    return pipeline_options(config, data, DataArguments(), truncation_mode=config.truncation_mode)


DPO_OPTIONS = (PrefixDPOConfig, DPOModelArguments, DataArguments)  # what `prefixdpo train` parses
