"""Sharded engines for the trainer: an engine the user asked for is applied, or refused in one line.

transformers.Trainer hands sharding to accelerate. accelerate 1.15 turns FSDP on only for GPU-like
devices: on CPU it silently trains plain DDP instead, although torch's FSDP2 (`fully_shard`) runs on CPU
with gloo. `enable_requested_fsdp` puts the requested FSDP2 plugin back into accelerate's state, so the
CPU run takes the very path a GPU run takes (accelerate's `fsdp2_prepare_model`, its FSDP checkpointing
and gradient clipping), and the tests exercise it here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

from prefixdpo.errors import ConfigError


@dataclass(frozen=True)
class EngineSettings:
    """What the engine code reads of a run's options, built once from its config (`training.settings`).

    fsdp_plugin_args:     the FSDP plugin arguments Trainer made of `fsdp` / `fsdp_config`; None: no FSDP asked
    whole_weight_options: the run's options, set, that read every weight whole (a method's: refused under ZeRO-3)
    """

    fsdp_plugin_args: Mapping | None = None
    whole_weight_options: tuple[str, ...] = ()


def fsdp_requested(settings: EngineSettings) -> bool:
    """Whether the training options ask for FSDP (`--fsdp ...`). (`accelerate launch` with an FSDP config
    is accelerate's to apply: on GPUs it does; on CPU its launcher runs one process without FSDP. Its
    `ACCELERATE_USE_FSDP` variable cannot tell: accelerate also sets it in-process for any FSDP plugin.)"""
    return settings.fsdp_plugin_args is not None


def enable_requested_fsdp(accelerator, settings: EngineSettings) -> bool:
    """After `Trainer.create_accelerator_and_postprocess`: make sure a requested FSDP is on, or refuse; returns
    whether FSDP is on (Trainer's `is_fsdp_enabled`).

    Where accelerate already enabled it (GPUs), nothing changes. On CPU with several processes, the
    plugin Trainer built from `fsdp`/`fsdp_config` is installed as accelerate would install it on a GPU.
    """
    state = accelerator.state
    if not fsdp_requested(settings) or getattr(state, "fsdp_plugin", None) is not None:
        return getattr(state, "fsdp_plugin", None) is not None
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if state.distributed_type == DistributedType.DEEPSPEED:
        raise ConfigError("fsdp and deepspeed are both set: choose one engine")
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise ConfigError(
            f"fsdp was requested but this run is {state.distributed_type.value} with {state.num_processes} "
            "process(es): launch it with several processes (torchrun --nproc_per_node N, or accelerate launch)"
        )
    plugin = FullyShardedDataParallelPlugin(**settings.fsdp_plugin_args)
    if plugin.fsdp_version != 2:
        raise ConfigError("fsdp on CPU needs FSDP2: set fsdp_config version 2 (FSDP1 is deprecated)")
    # as accelerate does on a GPU: AcceleratorState re-reads PartialState's shared type on every construction
    from accelerate.state import PartialState

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    return True


def refuse_unsupported_engine_options(accelerator, settings: EngineSettings) -> None:
    """ConfigError for an option the engine would run wrongly: under ZeRO-3 each rank holds only a partition of
    every weight, which an option in `settings.whole_weight_options` (e.g. DPO's in-place reference update, a
    reference table built outside the engine) would read as if whole. (Prefix reuse runs under every engine: its
    ranks agree on their passes, `core.prefix_reuse`.)"""
    from prefixdpo.core.engines_deepspeed import zero_stage

    if zero_stage(accelerator) != 3:
        return
    if settings.whole_weight_options:
        option = settings.whole_weight_options[0]
        raise ConfigError(f"{option}=True is not supported with DeepSpeed ZeRO-3 yet: use ZeRO-2 or FSDP2")


@contextlib.contextmanager
def whole_model_state_dict(accelerator):
    """Within: FSDP saves gather the whole model, also where checkpoints are sharded (`SHARDED_STATE_DICT`,
    the fast way to checkpoint). A model the user exports must load with stock `from_pretrained`."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or "SHARDED" not in str(plugin.state_dict_type):
        yield
        return
    previous = plugin.state_dict_type
    plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        yield
    finally:
        plugin.set_state_dict_type(previous)


def prepare_reference_for_engine(ref_model, accelerator):
    """A separate frozen reference model, prepared the way the policy's engine needs: sharded like the
    policy under FSDP (TRL's `prepare_fsdp`), a ZeRO inference engine under DeepSpeed (TRL's rules,
    `engines_deepspeed`); else moved to the device. Always in eval mode with no gradients."""
    from accelerate.utils import DistributedType

    ref_model.requires_grad_(False)
    ref_model.eval()
    kind = accelerator.state.distributed_type
    if kind == DistributedType.FSDP:
        from trl.models import prepare_fsdp

        ref_model.to(accelerator.device)
        return prepare_fsdp(ref_model, accelerator)
    if kind == DistributedType.DEEPSPEED:
        from prefixdpo.core.engines_deepspeed import prepare_deepspeed_reference

        return prepare_deepspeed_reference(ref_model, accelerator)
    return ref_model.to(accelerator.device)


def describe_engine(accelerator, model) -> str:
    """One line saying what runs the model: the engine, the processes, and (FSDP2) how much is sharded."""
    kind = accelerator.state.distributed_type
    processes = accelerator.num_processes
    if accelerator.is_fsdp2:
        sharded, params = sharded_parameter_count(model)
        return (f"FSDP2 over {processes} processes: {sharded} of {params} parameters sharded; this process holds "
                f"{local_numel(model):,} of {sum(p.numel() for p in model.parameters()):,} elements")
    if processes == 1:
        return f"one process on {accelerator.device}"
    return f"{kind.value} over {processes} processes"


def sharded_parameter_count(model) -> tuple[int, int]:
    """(parameters held as sharded DTensors, all parameters) of `model`: how a test or a log line shows
    that FSDP2 really sharded it."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    sharded = sum(isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements) for p in params)
    return int(sharded), len(params)


def local_numel(model) -> int:
    """Elements of `model`'s parameters stored on this rank (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    return int(sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()))


__all__ = ["EngineSettings", "describe_engine", "enable_requested_fsdp", "fsdp_requested", "local_numel",
           "prepare_reference_for_engine", "refuse_unsupported_engine_options", "sharded_parameter_count",
           "whole_model_state_dict"]


def name_deepspeed_accelerator() -> None:
    """Tell DeepSpeed, where it is installed, that this machine's accelerator is the CPU, when it is.

    accelerate imports DeepSpeed wherever it is installed (`extract_model_from_parallel`, which every
    `save_pretrained` calls), on runs that never use it; DeepSpeed then probes for an accelerator and, finding none,
    prints a "Setting accelerator to CPU" warning at the top of a plain CPU run. Named here (`DS_ACCELERATOR`, its own
    variable), it probes nothing and says nothing. Left alone where the user set it, or where any device DeepSpeed
    knows could be present (CUDA, MPS, XPU, or an NPU / HPU plugin installed)."""
    import importlib.util
    import os

    if "DS_ACCELERATOR" in os.environ or importlib.util.find_spec("deepspeed") is None:
        return
    plugins = ("torch_npu", "habana_frameworks", "intel_extension_for_pytorch")
    if any(importlib.util.find_spec(plugin) for plugin in plugins):
        return
    import torch

    xpu = getattr(torch, "xpu", None)
    if torch.cuda.is_available() or torch.backends.mps.is_available() or (xpu is not None and xpu.is_available()):
        return
    os.environ["DS_ACCELERATOR"] = "cpu"
