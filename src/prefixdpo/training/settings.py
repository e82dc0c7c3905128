"""A trainer's config, turned once into the small frozen settings the layers below read: `data/` and `core/` never
see TrainingArguments.

- the loaders' (`data.loader.LoaderSettings`): `loader_settings`;
- the fit check's (`core.fit.FitSettings`): `fit_settings`;
- the engines' (`core.engines.EngineSettings`): `engine_settings`;
- the loss's are the method's own (DPO: `dpo.step.Objective.from_config`, `LossParams.from_config`).
"""

from __future__ import annotations

from prefixdpo.core.engines import EngineSettings, enable_requested_fsdp, refuse_unsupported_engine_options
from prefixdpo.core.fit import Batches, FitSettings
from prefixdpo.core.sequence_parallel import pad_multiple_for
from prefixdpo.data.loader import LoaderSettings
from prefixdpo.training.nonfinite import check_engine_support

__all__ = ["loader_settings", "fit_settings", "engine_settings", "apply_engine_settings"]


def loader_settings(args, *, train: bool, batch_size: int, pad_token: int, backend: str) -> LoaderSettings:
    """The loader settings of a training (shuffled unless `train_sampling_strategy="sequential"`, grouped in
    optimizer steps) or evaluation (file order) loader."""
    return LoaderSettings(
        batch_size=batch_size, prefix_sharing=args.prefix_sharing, packing=args.packing,
        pack_length=None if str(args.pack_length) == "auto" else int(args.pack_length),
        pad_token_id=pad_token,
        # every line splits evenly over the sequence-parallel ranks
        pad_multiple=pad_multiple_for(args.pad_to_multiple_of, getattr(args, "sequence_parallel_size", 1)),
        bucket=backend == "flex",  # compiled flex: few line lengths, few recompiles
        shuffle=train,
        sequential=train and args.train_sampling_strategy == "sequential",
        seed=args.data_seed if args.data_seed is not None else args.seed,
        grad_accum=args.gradient_accumulation_steps if train else 1,
        prefix_tree=args.prefix_tree,
    )


def fit_settings(args, backend: str, extra_passes: tuple[Batches, ...] = ()) -> FitSettings:
    """What `core.fit.check_run_fits` reads of a run: its loaders' settings at the configured micro-batch sizes, the
    backend, the device and the compute precision; `extra_passes`: a method's own passes over every dataset."""
    def loader(train: bool) -> LoaderSettings:
        size = args.per_device_train_batch_size if train else args.per_device_eval_batch_size
        return loader_settings(args, train=train, batch_size=size, pad_token=0, backend=backend)

    return FitSettings(train=loader(True), eval=loader(False), backend=backend, device=args.device,
                       half_precision=bool(args.bf16 or args.fp16), extra_passes=tuple(extra_passes))


def engine_settings(args, whole_weight_options: tuple[str, ...] = ()) -> EngineSettings:
    """What `core.engines` reads of a run: the FSDP plugin arguments Trainer made of `fsdp`/`fsdp_config` (None:
    no FSDP asked) and the method's options set in this run that read every weight whole."""
    return EngineSettings(fsdp_plugin_args=getattr(args, "fsdp_plugin_args", None),
                          whole_weight_options=tuple(whole_weight_options))


def apply_engine_settings(trainer, nonfinite: str, whole_weight_options: tuple[str, ...] = ()) -> None:
    """After `Trainer.create_accelerator_and_postprocess`, for every prefixdpo trainer: a requested FSDP on
    (accelerate drops it on CPU) or refused, the options a sharded engine would run wrongly refused (sets
    `trainer.is_fsdp_enabled`), and an engine under which the run's `nonfinite` policy cannot hold refused
    (`nonfinite.check_engine_support`); each refusal one line."""
    settings = engine_settings(trainer.args, whole_weight_options)
    trainer.is_fsdp_enabled = enable_requested_fsdp(trainer.accelerator, settings)
    refuse_unsupported_engine_options(trainer.accelerator, settings)
    check_engine_support(trainer, nonfinite)
