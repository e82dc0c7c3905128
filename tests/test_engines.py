"""engines.py without launching processes: what a ZeRO-3 run refuses, and when FSDP counts as requested."""

from types import SimpleNamespace

import pytest

from prefixdpo.core.engines import fsdp_requested, refuse_unsupported_engine_options
from prefixdpo.dpo.trainer import PrefixDPOTrainer
from prefixdpo.errors import ConfigError
from prefixdpo.training.settings import engine_settings


def _accelerator(stage):
    plugin = None if stage is None else SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": stage}})
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))


def _dpo_engine_settings(**options):
    """The engine settings a DPO run of these options builds (`PrefixDPOTrainer._whole_weight_options`)."""
    args = SimpleNamespace(fsdp_plugin_args=None, **{"sync_ref_model": False, "precompute_ref_log_probs": False,
                                                      **options})
    return engine_settings(args, PrefixDPOTrainer._whole_weight_options(SimpleNamespace(args=args)))


@pytest.mark.parametrize("option", ["sync_ref_model", "precompute_ref_log_probs"])
def test_zero3_refuses_options_that_would_read_partitions_as_whole_weights(option):
    with pytest.raises(ConfigError, match=f"{option}=True is not supported with DeepSpeed ZeRO-3"):
        refuse_unsupported_engine_options(_accelerator(3), _dpo_engine_settings(**{option: True}))
    for stage in (None, 0, 2):  # whole weights on every rank: allowed
        refuse_unsupported_engine_options(_accelerator(stage), _dpo_engine_settings(**{option: True}))
    refuse_unsupported_engine_options(_accelerator(3), _dpo_engine_settings(**{option: False}))


def test_fsdp_is_requested_by_the_training_options(monkeypatch):
    assert not fsdp_requested(engine_settings(SimpleNamespace(fsdp_plugin_args=None)))
    assert fsdp_requested(engine_settings(SimpleNamespace(fsdp_plugin_args={"fsdp_version": 2})))
    # accelerate sets this in-process for any FSDP plugin: a later run in the same process did not ask for FSDP
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert not fsdp_requested(engine_settings(SimpleNamespace(fsdp_plugin_args=None)))
