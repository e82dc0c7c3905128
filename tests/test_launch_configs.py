"""The shipped `accelerate launch` configs (examples/accelerate/*.yaml) read as accelerate 1.15 reads them.

Each file is loaded with accelerate's own config loader, then taken through `accelerate launch`'s own
argument merging and environment preparation (what the launched processes receive), and the plugins the
training processes build from that environment are checked: FSDP version 2 with transformer-based
wrapping and sharded checkpoints, ZeRO stage 2 / 3, and the batch and clipping settings left to the
training options. No process is launched (these engines need GPUs, DeepSpeed, or both).
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "accelerate"
EXPECTED = {"ddp.yaml": "MULTI_GPU", "fsdp2.yaml": "FSDP", "zero2.yaml": "DEEPSPEED", "zero3.yaml": "DEEPSPEED"}


def _launch_env(name: str, *extra: str):
    """(merged launch args, environment of the launched processes) for `accelerate launch --config_file name`."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    argv = ["--config_file", str(CONFIGS / name), *extra, "train.py"]
    args, defaults, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.use_deepspeed:  # as `accelerate launch` itself does before its DeepSpeed launcher
        fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return args, env


def test_the_shipped_set_is_complete():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerates_loader(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    cfg = load_config_from_file(str(CONFIGS / name))  # refuses unknown keys
    assert isinstance(cfg, ClusterConfig)
    assert cfg.distributed_type.value == EXPECTED[name]
    assert cfg.compute_environment.value == "LOCAL_MACHINE"
    # placeholders the command line overrides: --num_processes, --num_machines, --machine_rank
    assert cfg.num_processes == 8 and cfg.num_machines == 1 and cfg.machine_rank == 0
    assert cfg.mixed_precision == "no"  # precision comes from the training options (--bf16 true)
    assert cfg.use_cpu is False
    args, _ = _launch_env(name, "--num_processes", "2")
    assert args.num_processes == 2  # the placeholder yields to the command line


def test_fsdp2_config_gives_fsdp2_full_shard_transformer_wrap_sharded_checkpoints():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    args, env = _launch_env("fsdp2.yaml", "--num_processes", "2")
    assert args.use_fsdp and not args.use_deepspeed
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True  # full shard: parameters resharded after each forward
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert plugin.transformer_cls_names_to_wrap is None  # the model's own `_no_split_modules` decide
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert plugin.cpu_ram_efficient_loading is True  # rank 0 reads the weights, the others get their shards
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)  # FSDP2's "no offload" policy
    assert plugin.activation_checkpointing is False


@pytest.mark.parametrize("name, stage", [("zero2.yaml", 2), ("zero3.yaml", 3)])
def test_zero_configs_give_their_stage_and_leave_batching_to_the_training_options(name, stage):
    from accelerate.utils import DeepSpeedPlugin

    args, env = _launch_env(name, "--num_processes", "2")
    assert args.use_deepspeed and not args.use_fsdp
    with mock.patch.dict(os.environ, env):
        plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == stage == plugin.deepspeed_config["zero_optimization"]["stage"]
    # ZeRO-3 loads the model partitioned (zero.Init) and can save one gathered model; ZeRO-2 needs neither
    assert plugin.zero3_init_flag is (stage == 3)
    assert plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is (stage == 3)
    assert plugin.deepspeed_config["zero_optimization"]["offload_param"]["device"] == "none"
    # filled by transformers from --gradient_accumulation_steps / --max_grad_norm / the batch size
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"
    assert plugin.deepspeed_config["gradient_clipping"] == "auto"
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"


def test_ddp_config_is_plain_data_parallel():
    args, env = _launch_env("ddp.yaml", "--num_processes", "2")
    assert args.multi_gpu and not args.use_fsdp and not args.use_deepspeed
    assert "ACCELERATE_USE_FSDP" not in env and "ACCELERATE_USE_DEEPSPEED" not in env


def test_several_machines_take_their_rank_and_the_main_address_from_the_command_line():
    # the README's two-machine form: 16 processes in all, this is machine 1 of 2
    args, _ = _launch_env("fsdp2.yaml", "--num_processes", "16", "--num_machines", "2", "--machine_rank", "1",
                          "--main_process_ip", "10.0.0.1", "--main_process_port", "29500")
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "8")
    # torchrun's rendezvous on the main machine (or master_addr/port where --same_network is given)
    assert getattr(args, "rdzv_endpoint", None) == "10.0.0.1:29500" or (
        (getattr(args, "master_addr", None), getattr(args, "master_port", None)) == ("10.0.0.1", "29500"))
