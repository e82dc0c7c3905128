"""TRL 1.16 `DPOConfig` compatibility of `PrefixDPOConfig`: every TRL field exists here with TRL's type and
default (a new TRL field fails the first test), TRL's DPO defaults resolve as documented (bf16 only where the
device has it, so fp32 on CPU, without warnings), and a TRL DPO YAML runs unchanged with `prefixdpo train`
and means what TRL reads from it."""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import get_type_hints

import pytest
import torch

from prefixdpo.commands.train import parse_train_args
from prefixdpo import PrefixDPOConfig
from prefixdpo.dpo.loss_table import LossParams
from prefixdpo.errors import ConfigError

trl = pytest.importorskip("trl")

# TRL fields whose default differs here, each with the reason. Nothing else may differ.
DEFAULT_EXCEPTIONS = {
    # TrainingArguments' None writes to ./trainer_output; ours to ./prefixdpo-output (git-ignored in this
    # repository). Where the run is written, not what it computes; TRL's example configs set it anyway.
    "output_dir": "prefixdpo-output",
}


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def test_every_trl_dpoconfig_field_is_ours_with_trls_type_and_default():
    ours = {f.name: f for f in dataclasses.fields(PrefixDPOConfig)}
    our_types, trl_types = get_type_hints(PrefixDPOConfig), get_type_hints(trl.DPOConfig)
    trl_fields = dataclasses.fields(trl.DPOConfig)
    assert len(trl_fields) > 120  # TrainingArguments' fields and DPOConfig's own
    missing = [f.name for f in trl_fields if f.name not in ours]
    assert not missing, f"TRL DPOConfig fields missing from PrefixDPOConfig: {missing}"
    wrong = []
    for f in trl_fields:
        if our_types[f.name] != trl_types[f.name]:
            wrong.append(f"{f.name}: type {our_types[f.name]} != TRL's {trl_types[f.name]}")
        if f.name in DEFAULT_EXCEPTIONS:
            assert _default(ours[f.name]) == DEFAULT_EXCEPTIONS[f.name] != _default(f), f.name  # not stale
        elif _default(ours[f.name]) != _default(f):
            wrong.append(f"{f.name}: default {_default(ours[f.name])!r} != TRL's {_default(f)!r}")
    assert not wrong, "\n".join(wrong)
    # the DPO-specific defaults TRL changes from TrainingArguments are among those checked
    for name, value in (("learning_rate", 1e-6), ("logging_steps", 10), ("gradient_checkpointing", True),
                        ("bf16", None), ("pad_to_multiple_of", "auto"), ("use_weighting", False),
                        ("ref_model_sync_steps", 512)):
        assert _default(ours[name]) == value, name


def test_trl_defaults_resolve_on_cpu_to_fp32_with_checkpointing_and_no_warnings(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TRL's own DPOConfig warns here (gradient_checkpointing deprecated)
        config = PrefixDPOConfig(output_dir=str(tmp_path))
    assert config.bf16 is False and config.fp16 is False  # TRL would set bf16=True, refused on a CPU-only machine
    assert config.activation_checkpointing is True and config.gradient_checkpointing is True
    assert config.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert config.pad_to_multiple_of is None  # 'auto' pads only on Neuron
    assert config.ddp_find_unused_parameters is False
    assert (config.learning_rate, config.logging_steps) == (1e-6, 10)
    # TRL's names switch checkpointing off; the new transformers name wins where both are given
    assert PrefixDPOConfig(output_dir=str(tmp_path), gradient_checkpointing=False).activation_checkpointing is False
    both = PrefixDPOConfig(output_dir=str(tmp_path), gradient_checkpointing=False, activation_checkpointing=True)
    assert both.activation_checkpointing is True and both.gradient_checkpointing is True


def test_bf16_default_follows_the_device(monkeypatch):
    import transformers.utils

    from prefixdpo.training.options import device_has_bf16

    monkeypatch.setattr(transformers.utils, "is_torch_bf16_gpu_available", lambda: True)
    assert device_has_bf16(use_cpu=False) is True
    assert device_has_bf16(use_cpu=True) is False  # use_cpu: fp32 even on a bf16 GPU machine
    monkeypatch.setattr(transformers.utils, "is_torch_bf16_gpu_available", lambda: False)
    assert device_has_bf16(use_cpu=False) is False


def test_the_loss_options_are_read_from_the_config_by_name_with_one_default_each(tmp_path):
    """`LossParams.from_config` reads every loss option of the config by its name; the config's defaults are
    LossParams' (written once), and every option set on the config reaches the loss."""
    assert LossParams.from_config(PrefixDPOConfig(output_dir=str(tmp_path))) == LossParams()
    changed = dict(beta=0.3, label_smoothing=0.2, discopop_tau=0.2, f_divergence_type="js_divergence",
                   f_alpha_divergence_coef=0.3, use_weighting=True, ld_alpha=0.5)
    config = PrefixDPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "discopop"], **changed)
    assert LossParams.from_config(config) == LossParams(**changed)
    simpo_orpo = dict(simpo_gamma=0.7, orpo_alpha=0.4)  # each refused unless its loss is configured
    config = PrefixDPOConfig(output_dir=str(tmp_path), loss_type=["simpo", "orpo"], **simpo_orpo)
    assert LossParams.from_config(config) == LossParams(**simpo_orpo)
    assert set(changed) | set(simpo_orpo) == {f.name for f in dataclasses.fields(LossParams)}


def test_trl_options_parse_and_reach_the_loss_params(tmp_path):
    config, _, _ = parse_train_args([
        "--output_dir", str(tmp_path), "--use_weighting", "--ld_alpha", "0.5", "--pad_to_multiple_of", "8",
        "--model_init_kwargs", '{"dtype": "float32", "revision": "main"}', "--dataset_num_proc", "4",
        "--padding_free", "--router_aux_loss_coef", "0.01", "--sync_ref_model", "--ref_model_mixup_alpha", "0.9",
        "--ref_model_sync_steps", "4", "--activation_offloading", "false", "--pad_token", "<pad>",
    ])
    assert config.model_init_kwargs == {"dtype": "float32", "revision": "main"}
    assert (config.pad_to_multiple_of, config.dataset_num_proc, config.padding_free) == (8, 4, True)
    assert (config.router_aux_loss_coef, config.sync_ref_model, config.ref_model_mixup_alpha,
            config.ref_model_sync_steps) == (0.01, True, 0.9, 4)
    params = LossParams.from_config(config)
    assert params.use_weighting is True and params.ld_alpha == 0.5
    assert PrefixDPOConfig(output_dir=str(tmp_path), pad_to_multiple_of="none").pad_to_multiple_of is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ld_alpha": 1.5}, "ld_alpha=1.5: must be in [0, 1]"),
        ({"ref_model_mixup_alpha": -0.1}, "ref_model_mixup_alpha=-0.1"),
        ({"ref_model_sync_steps": 0}, "ref_model_sync_steps=0"),
        ({"sync_ref_model": True, "precompute_ref_log_probs": True}, "sync_ref_model"),
        ({"pad_to_multiple_of": "eight"}, "pad_to_multiple_of='eight'"),
        ({"pad_to_multiple_of": 0}, "pad_to_multiple_of=0"),
        ({"model_init_kwargs": "dtype=float32"}, "model_init_kwargs='dtype=float32': expected a JSON object"),
    ],
)
def test_bad_trl_option_values_are_one_line_config_errors(tmp_path, options, message):
    with pytest.raises(ConfigError) as info:
        PrefixDPOConfig(output_dir=str(tmp_path), **options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_help_states_what_moot_options_do(capsys):
    from prefixdpo.cli import main

    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--padding_free", "--dataset_num_proc", "--remove_unused_columns", "--pad_token"):
        start = text.index(option)
        assert "Accepted, no effect" in text[start:start + 400], option
    assert "--packing is prefixdpo's padding" in text


def test_model_init_kwargs_reach_from_pretrained_by_trls_dtype_rule(tmp_path):
    from conftest import tiny_model

    from prefixdpo.core.models import init_kwargs_dtype, load_causal_lm

    path = tmp_path / "m"
    tiny_model("llama").save_pretrained(path)
    assert load_causal_lm(path, model_init_kwargs={"dtype": "bfloat16"}).dtype == torch.bfloat16
    # model_init_kwargs win over the dtype / bf16 arguments, and pass other keys through
    model = load_causal_lm(path, bf16=True, model_init_kwargs={"dtype": "float32", "attn_implementation": "eager"})
    assert model.dtype == torch.float32 and model.config._attn_implementation == "eager"
    assert init_kwargs_dtype("auto") == "auto" and init_kwargs_dtype(torch.float16) is torch.float16
    with pytest.raises(ConfigError, match="model_init_kwargs dtype='fp8'"):
        load_causal_lm(path, model_init_kwargs={"dtype": "fp8"})
    with pytest.raises(ConfigError, match="not to a config"):
        load_causal_lm(tiny_model("llama").config, model_init_kwargs={"dtype": "float32"})


def test_activation_offloading_context_off_is_a_no_op_and_refused_on_cpu():
    import contextlib

    from conftest import tiny_model

    from prefixdpo.core.offloading import activation_offloading_context

    model = tiny_model("llama")
    assert isinstance(activation_offloading_context(model, False), contextlib.nullcontext)
    with pytest.raises(ConfigError, match="activation_offloading moves activations .* the model is on cpu"):
        activation_offloading_context(model, True)


# A DPO config as TRL's docs write one for `trl dpo --config dpo.yaml` (ScriptArguments + DPOConfig +
# ModelConfig names), pointed at a locally built model and dataset.
TRL_YAML = """\
# dpo.yaml
model_name_or_path: {model}
dataset_name: {data}
dataset_train_split: train
output_dir: {out}
learning_rate: 1.0e-3
lr_scheduler_type: constant
num_train_epochs: 1
max_steps: 2
per_device_train_batch_size: 4
gradient_accumulation_steps: 1
beta: 0.1
loss_type: [sigmoid]
max_length: 1024
gradient_checkpointing: true
bf16: false
logging_steps: 1
eval_strategy: "no"
save_strategy: "no"
report_to: none
seed: 42
model_init_kwargs:
  dtype: float32
dataset_num_proc: 2
padding_free: false
"""


def test_a_trl_dpo_yaml_runs_unchanged_and_means_what_trl_reads(tmp_path, capsys, monkeypatch):
    import yaml
    from trl import DPOConfig, ModelConfig, ScriptArguments, TrlParser

    from prefixdpo.cli import main
    from prefixdpo_tools.demo import build_demo
    from prefixdpo import PrefixDPOTrainer

    base = build_demo(tmp_path / "base")
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(line + "\n" for line in base.train_file.read_text().splitlines()[:16]))
    path = tmp_path / "dpo.yaml"
    path.write_text(TRL_YAML.format(model=base.model_dir, data=data, out=tmp_path / "out"))
    values = yaml.safe_load(path.read_text())

    # TRL's own parser reads the file into its dataclasses; ours must read the same values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL: gradient_checkpointing is a deprecated alias
        trl_args = TrlParser((ScriptArguments, DPOConfig, ModelConfig)).parse_args_and_config(["--config", str(path)])
    trl_config = next(a for a in trl_args if isinstance(a, DPOConfig))
    config, model_args, data_args = parse_train_args([str(path)])
    dpo_keys = [k for k in values if k in {f.name for f in dataclasses.fields(DPOConfig)}]
    assert len(dpo_keys) == len(values) - 3  # all but model_name_or_path, dataset_name, dataset_train_split
    for key in dpo_keys:
        assert getattr(config, key) == getattr(trl_config, key), key
    assert (model_args.model_name_or_path, data_args.dataset_name) == (str(base.model_dir), str(data))

    seen = {}
    real_train = PrefixDPOTrainer.train

    def train(self, *args, **kwargs):
        seen["trainer"] = self
        return real_train(self, *args, **kwargs)

    monkeypatch.setattr(PrefixDPOTrainer, "train", train)
    assert main(["train", str(path)]) == 0
    stdout = capsys.readouterr().out
    assert "Loaded 16 records, kept 16 examples" in stdout and "Model saved to" in stdout
    trainer = seen["trainer"]
    assert trainer.state.global_step == 2 and trainer.model.is_activation_checkpointing
    assert trainer.args.learning_rate == 1e-3 and trainer.args.bf16 is False
    assert next(trainer.model.parameters()).dtype == torch.float32
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses)))
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"
