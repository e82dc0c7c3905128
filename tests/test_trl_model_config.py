"""TRL 1.16's `ModelConfig` and `ScriptArguments` on `prefixdpo train` and `prefixdpo reward` (issue 21).

- Every field of TRL's two dataclasses is ours with TRL's type, default and choices (a new TRL field fails), and
  every field lands where it is used: `LANDS` names, for each TRL field, the test here that shows its effect (a
  field without one fails): from_pretrained of the model, its tokenizer and a reference loaded by name (revision,
  dtype, attn_implementation, 4/8-bit), TRL's own PEFT config and the PEFT model built from it (every LoRA
  field), the splits read, DDP's ignored buffers.
- TRL's own DPO usage blocks (the docstring of trl/scripts/dpo.py) and reward usage blocks run unchanged apart
  from the program name, the local model and data, and `--max_steps`; `--use_peft` trains adapters only.
- `--use_rslora`, `--use_dora`, `--lora_modules_to_save lm_head` change what trains exactly as the PEFT model TRL
  builds from the same arguments.
- What cannot run here is refused in one line: quantized loading without CUDA or bitsandbytes, streaming.

A locally built 0.56M-parameter Llama (no downloads). About 25 s on 2 busy cores (seven command-line runs;
TRL's four usage blocks train 1 or 2 optimizer steps of their own batch settings).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import get_type_hints

import pytest
import torch

from conftest import cpu_half_dtype, make_examples, tiny_model
from prefixdpo.cli import main
from prefixdpo.commands.train import parse_train_args
from prefixdpo_tools.demo import DemoSpec, build_demo
from prefixdpo.dpo.config import DPOModelArguments
from prefixdpo.errors import ConfigError, UserError
from prefixdpo.reward.config import RewardDataArguments, RewardModelArguments
from prefixdpo.training.model_options import ModelArguments
from prefixdpo.training.options import DataArguments, ScriptArguments

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

# the half precision the loading options ask for (bfloat16, or float16 where this CPU cannot attend in bf16)
HALF = cpu_half_dtype()
HALF_NAME = str(HALF).removeprefix("torch.")

# Where our default differs from TRL's, and why. Nothing else may differ.
DEFAULT_EXCEPTIONS = {
    # TRL's CAUSAL_LM would wrap a reward model so that its new score head never trains (TRL's reward docs pass
    # --lora_task_type SEQ_CLS); here it is the default and anything else is refused.
    (RewardModelArguments, "lora_task_type"): "SEQ_CLS",
}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _differences(trl_class, ours) -> list[str]:
    mine = {f.name: f for f in dataclasses.fields(ours)}
    our_types, trl_types = get_type_hints(ours), get_type_hints(trl_class)
    wrong = []
    for f in dataclasses.fields(trl_class):
        if f.name not in mine:
            wrong.append(f"{f.name}: missing")
            continue
        if our_types[f.name] != trl_types[f.name]:
            wrong.append(f"{f.name}: type {our_types[f.name]} != TRL's {trl_types[f.name]}")
        expected = DEFAULT_EXCEPTIONS.get((ours, f.name), _default(f))
        if _default(mine[f.name]) != expected:
            wrong.append(f"{f.name}: default {_default(mine[f.name])!r} != {expected!r}")
        if mine[f.name].metadata.get("choices") != f.metadata.get("choices"):
            wrong.append(f"{f.name}: choices {mine[f.name].metadata.get('choices')} != TRL's")
    return wrong


@pytest.mark.parametrize("ours", [ModelArguments, DPOModelArguments, RewardModelArguments], ids=lambda c: c.__name__)
def test_every_trl_modelconfig_field_is_ours_with_trls_type_default_and_choices(ours):
    assert len(dataclasses.fields(trl.ModelConfig)) >= 19
    assert not _differences(trl.ModelConfig, ours)


@pytest.mark.parametrize("ours", [ScriptArguments, DataArguments, RewardDataArguments], ids=lambda c: c.__name__)
def test_every_trl_scriptarguments_field_is_ours_with_trls_type_and_default(ours):
    assert len(dataclasses.fields(trl.ScriptArguments)) >= 6
    assert not _differences(trl.ScriptArguments, ours)


def test_the_exceptions_are_still_exceptions():
    for (ours, name), value in DEFAULT_EXCEPTIONS.items():
        trl_field = next(f for f in dataclasses.fields(trl.ModelConfig) if f.name == name)
        assert value != _default(trl_field), name  # stale once TRL agrees


# Each TRL field -> the test below that shows where it lands (what it changes).
LANDS = {
    "model_name_or_path": "test_model_options_reach_from_pretrained_of_model_tokenizer_and_reference",
    "model_revision": "test_model_options_reach_from_pretrained_of_model_tokenizer_and_reference",
    "dtype": "test_model_options_reach_from_pretrained_of_model_tokenizer_and_reference",
    "attn_implementation": "test_model_options_reach_from_pretrained_of_model_tokenizer_and_reference",
    "use_peft": "test_lora_options_build_trls_peft_config_and_shape_the_model",
    "lora_r": "test_lora_options_build_trls_peft_config_and_shape_the_model",
    "lora_alpha": "test_lora_options_build_trls_peft_config_and_shape_the_model",
    "lora_dropout": "test_lora_options_build_trls_peft_config_and_shape_the_model",
    "lora_target_modules": "test_lora_options_build_trls_peft_config_and_shape_the_model",
    "lora_modules_to_save": "test_lora_options_build_trls_peft_config_and_shape_the_model",
    "use_rslora": "test_lora_options_build_trls_peft_config_and_shape_the_model",
    "use_dora": "test_lora_options_build_trls_peft_config_and_shape_the_model",
    "lora_task_type": "test_reward_command_loads_the_same_way_and_trains_the_score_head",
    "lora_target_parameters": "test_lora_target_parameters_adapt_a_parameter",
    "load_in_4bit": "test_quantization_options_reach_from_pretrained_as_trls_config",
    "load_in_8bit": "test_quantization_options_reach_from_pretrained_as_trls_config",
    "bnb_4bit_quant_type": "test_quantization_options_reach_from_pretrained_as_trls_config",
    "use_bnb_nested_quant": "test_quantization_options_reach_from_pretrained_as_trls_config",
    "bnb_4bit_quant_storage": "test_quantization_options_reach_from_pretrained_as_trls_config",
    "dataset_name": "test_dataset_options_pick_the_splits",
    "dataset_train_split": "test_dataset_options_pick_the_splits",
    "dataset_test_split": "test_dataset_options_pick_the_splits",
    "dataset_config": "test_dataset_config_reaches_load_dataset",
    "dataset_streaming": "test_dataset_streaming_is_refused_in_one_line",
    "ignore_bias_buffers": "test_ignore_bias_buffers_lands_in_ddp",
}


def test_every_trl_field_has_a_test_of_where_it_lands():
    trl_fields = {f.name for cls in (trl.ModelConfig, trl.ScriptArguments) for f in dataclasses.fields(cls)}
    assert set(LANDS) == trl_fields, set(LANDS) ^ trl_fields
    assert all(callable(globals().get(name)) for name in LANDS.values())


# ---------------------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A small Llama + tokenizer, and a dataset folder with train (16), validation (8) and test (6) splits."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("trlcli")
    paths = build_demo(root / "base", DemoSpec(num_train=24, num_eval=6))
    lines = paths.train_file.read_text().splitlines()
    data = root / "prefs"
    data.mkdir()
    (data / "train.jsonl").write_text("\n".join(lines[:16]) + "\n")
    (data / "validation.jsonl").write_text("\n".join(lines[16:24]) + "\n")
    (data / "test.jsonl").write_text(paths.eval_file.read_text())
    return SimpleNamespace(model=str(paths.model_dir), data=str(data), root=root)


def spy_loads(mp: pytest.MonkeyPatch, bool_buffer: bool = False) -> list[dict]:
    """Record every from_pretrained of a model or tokenizer (its kwargs, and the model's attention and dtype as
    loaded). bool_buffer: the first causal LM loaded gets a boolean buffer, as some architectures register."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    loads: list[dict] = []
    for cls in (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer):
        real = cls.from_pretrained

        def spy(name, *args, _real=real, _kind=cls.__name__, **kwargs):
            obj = _real(name, *args, **kwargs)
            entry = {"kind": _kind, "name": str(name), "kwargs": kwargs}
            if hasattr(obj, "config"):
                entry.update(attn=obj.config._attn_implementation, dtype=obj.dtype)
                if bool_buffer and _kind == "AutoModelForCausalLM" and not any("buf" in e for e in loads):
                    obj.model.register_buffer("causal_flags", torch.ones(3, dtype=torch.bool))
                    entry["buf"] = True
            loads.append(entry)
            return obj

        mp.setattr(cls, "from_pretrained", spy)
    return loads


def run_command(mp: pytest.MonkeyPatch, argv: list[str], *, train: bool = True):
    """`prefixdpo ARGV` in this process: (exit code, the trainer it built, stdout, stderr). train=False: the
    trainer is built but `train` returns at once (what the options did to the model is in place by then). The
    PEFT config the command gave the trainer is `trainer.given_peft_config` (PEFT fills in its copy)."""
    import copy

    from prefixdpo.dpo.trainer import PrefixDPOTrainer
    from prefixdpo.reward.trainer import PrefixRewardTrainer

    seen = {}
    for cls in (PrefixDPOTrainer, PrefixRewardTrainer):
        real_init, real = cls.__init__, cls.train

        def init(self, *args, _real=real_init, **kwargs):
            given = copy.deepcopy(kwargs.get("peft_config"))
            _real(self, *args, **kwargs)
            self.given_peft_config = given

        mp.setattr(cls, "__init__", init)

        def wrapped(self, *args, _real=real, **kwargs):
            seen["trainer"] = self
            return _real(self, *args, **kwargs) if train else None

        mp.setattr(cls, "train", wrapped)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, seen.get("trainer"), out.getvalue(), err.getvalue()


def trl_model_config(argv: list[str]):
    """TRL's own `ModelConfig` parsed from `argv` by TRL's parser (other options left aside)."""
    model_config, _rest = trl.TrlParser((trl.ModelConfig,)).parse_args_into_dataclasses(
        argv, return_remaining_strings=True)
    return model_config


LORA_KEYS = ("r", "lora_alpha", "lora_dropout", "target_modules", "target_parameters", "modules_to_save",
             "task_type", "use_rslora", "use_dora", "bias")


def lora_fields(config) -> dict:
    return {key: getattr(config, key) for key in LORA_KEYS}


DPO_ARGV = ["--model_revision", "v1", "--dtype", HALF_NAME, "--attn_implementation", "eager",
            "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.1",
            "--lora_target_modules", "q_proj", "k_proj", "--lora_modules_to_save", "lm_head", "--use_rslora",
            "--use_dora", "--dataset_train_split", "validation", "--eval_strategy", "epoch",
            "--ignore_bias_buffers", "--disable_dropout", "false", "--gradient_checkpointing", "false",
            "--report_to", "none"]


@pytest.fixture(scope="module")
def dpo_run(local):
    """One `prefixdpo train` with every model and script option set away from its default (train returns at
    once: the options have done their work when the trainer exists)."""
    argv = ["train", "--model_name_or_path", local.model, "--ref_model_name_or_path", local.model,
            "--dataset_name", local.data, "--output_dir", str(local.root / "dpo-out"), *DPO_ARGV]
    with pytest.MonkeyPatch.context() as mp:
        loads = spy_loads(mp, bool_buffer=True)
        code, trainer, out, err = run_command(mp, argv, train=False)
    assert code == 0, err
    return SimpleNamespace(trainer=trainer, loads=loads, out=out, err=err, argv=argv)


# ------------------------------------------------------------------------------------ where each field lands


def test_model_options_reach_from_pretrained_of_model_tokenizer_and_reference(dpo_run, local):
    models = [e for e in dpo_run.loads if e["kind"] == "AutoModelForCausalLM"]
    tokenizers = [e for e in dpo_run.loads if e["kind"] == "AutoTokenizer"]
    assert [e["name"] for e in models] == [local.model, local.model]  # the model, then the named reference
    for entry in models:
        assert entry["kwargs"]["revision"] == "v1" and entry["kwargs"]["attn_implementation"] == "eager"
        assert entry["attn"] == "eager" and entry["dtype"] == HALF  # as loaded, before prefixdpo's
    assert [e["kwargs"].get("revision") for e in tokenizers] == ["v1"]
    trainer = dpo_run.trainer
    assert trainer.ref_model is not None and next(trainer.ref_model.parameters()).dtype == HALF
    base = trainer.model.get_base_model()
    assert base.model.embed_tokens.weight.dtype == HALF
    # every training pass runs prefixdpo's registered attention, whatever the model was loaded with
    assert base.config._attn_implementation == trainer.ref_model.config._attn_implementation == "prefixdpo"


def test_lora_options_build_trls_peft_config_and_shape_the_model(dpo_run):
    trainer = dpo_run.trainer
    ours = trainer.model.peft_config["default"]
    theirs = trl.get_peft_config(trl_model_config(dpo_run.argv[1:]))
    assert lora_fields(trainer.given_peft_config) == lora_fields(theirs)
    assert (ours.r, ours.lora_alpha, ours.lora_dropout, ours.use_rslora, ours.use_dora) == (4, 8, 0.1, True, True)
    assert set(ours.target_modules) == {"q_proj", "k_proj"} and ours.modules_to_save == ["lm_head"]
    assert type(trainer.model).__name__ == "PeftModelForCausalLM" and ours.task_type == "CAUSAL_LM"
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    adapted = {m.group(1) for n in trainable if (m := re.search(r"\.(\w+_proj)\.lora_A\.", n))}
    assert adapted == {"q_proj", "k_proj"}  # not PEFT's default q_proj v_proj
    q_proj = trainer.model.get_base_model().model.layers[0].self_attn.q_proj
    assert q_proj.lora_A["default"].weight.shape[0] == 4  # lora_r
    assert q_proj.scaling["default"] == pytest.approx(8 / 4 ** 0.5)  # rsLoRA: alpha / sqrt(r), not alpha / r
    assert q_proj.lora_dropout["default"].p == 0.1  # kept: --disable_dropout false
    assert any("lora_magnitude_vector" in n for n in trainable)  # DoRA
    assert any(n.startswith("base_model.model.lm_head.modules_to_save.") for n in trainable)
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)  # adapters (and lm_head) only


def test_dataset_options_pick_the_splits(dpo_run):
    assert "Train data: Loaded 8 records" in dpo_run.out  # the validation split, 8 records
    assert "Held-out data: Loaded 6 records" in dpo_run.out  # the test split, read since eval_strategy is epoch
    assert len(dpo_run.trainer.train_dataset) == 8 and len(dpo_run.trainer.eval_dataset) == 6


def test_ignore_bias_buffers_lands_in_ddp(dpo_run, tmp_path):
    """TRL's script names the model's boolean buffers in `_ddp_params_and_buffers_to_ignore`; DDP reads it."""
    model = dpo_run.trainer.model
    assert model._ddp_params_and_buffers_to_ignore == ["base_model.model.model.causal_flags"]
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from prefixdpo.training.model_setup import ignore_bool_buffers_in_ddp

    small = tiny_model("llama")
    small.model.register_buffer("causal_flags", torch.ones(3, dtype=torch.bool))
    assert ignore_bool_buffers_in_ddp(small) == ["model.causal_flags"]  # bool buffers only (not inv_freq)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert DistributedDataParallel(small).parameters_to_ignore == {"model.causal_flags"}
    finally:
        dist.destroy_process_group()


def test_reward_command_loads_the_same_way_and_trains_the_score_head(local):
    argv = ["reward", "--model_name_or_path", local.model, "--dataset_name", local.data, "--output_dir",
            str(local.root / "rm-out"), "--model_revision", "v2", "--attn_implementation", "eager", "--dtype",
            HALF_NAME, "--use_peft", "--lora_r", "4", "--report_to", "none"]
    with pytest.MonkeyPatch.context() as mp:
        loads = spy_loads(mp)
        code, trainer, _, err = run_command(mp, argv, train=False)
    assert code == 0, err
    model_load = next(e for e in loads if e["kind"] == "AutoModelForSequenceClassification")
    assert model_load["kwargs"]["revision"] == "v2" and model_load["attn"] == "eager"
    assert model_load["dtype"] == HALF and model_load["kwargs"]["num_labels"] == 1
    assert [e["kwargs"].get("revision") for e in loads if e["kind"] == "AutoTokenizer"] == ["v2"]
    ours = trainer.model.peft_config["default"]
    assert ours.task_type == "SEQ_CLS" and type(trainer.model).__name__ == "PeftModelForSequenceClassification"
    assert lora_fields(trainer.given_peft_config) == lora_fields(trl.get_peft_config(trl_model_config(
        [*argv[1:], "--lora_task_type", "SEQ_CLS"])))  # TRL's reward docs' spelling builds the same config
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any(".score.modules_to_save." in n for n in trainable)  # the new head trains fully
    # TRL's default CAUSAL_LM would leave that head frozen: refused in one line
    with pytest.raises(ConfigError, match="^lora_task_type=CAUSAL_LM would leave the reward model's score head"):
        RewardModelArguments(use_peft=True, lora_task_type="CAUSAL_LM")


def test_lora_target_parameters_adapt_a_parameter(tmp_path):
    from prefixdpo import PrefixDPOTrainer

    argv = ["--use_peft", "--lora_target_parameters", "mlp.gate_proj.weight",
            "--lora_dropout", "0"]  # PEFT's parameter wrapper has no dropout
    _, model_args, _ = parse_train_args(argv)
    ours = model_args.peft_config()
    assert lora_fields(ours) == lora_fields(trl.get_peft_config(trl_model_config(argv)))
    args = _small_config(tmp_path)
    trainer = PrefixDPOTrainer(model=tiny_model("llama"), args=args, train_dataset=make_examples(8),
                               peft_config=ours)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any(".mlp.gate_proj.lora_B." in n for n in trainable)  # beside PEFT's default targets
    assert not any(".up_proj." in n for n in trainable)
    trainer.train()
    gate_b = trainer.model.get_base_model().model.layers[0].mlp.gate_proj.lora_B["default"].weight
    assert gate_b.abs().max() > 0  # zero at init: the parameter's adapter trained


def _small_config(tmp_path, **kw):
    from prefixdpo import PrefixDPOConfig

    return PrefixDPOConfig(**{**dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        report_to="none", gradient_checkpointing=False, logging_steps=1), **kw})


@pytest.mark.parametrize("command", ["train", "reward"])
@pytest.mark.parametrize("options", [
    ["--load_in_4bit", "--bnb_4bit_quant_type", "fp4", "--use_bnb_nested_quant", "--bnb_4bit_quant_storage",
     "bfloat16", "--dtype", "bfloat16"],
    ["--load_in_8bit"],
], ids=["4bit", "8bit"])
def test_quantization_options_reach_from_pretrained_as_trls_config(local, tmp_path, monkeypatch, command, options):
    """On a machine with CUDA and bitsandbytes (injected: the check passes), the config that reaches
    from_pretrained is TRL's `get_quantization_config` of the same arguments, with the model on this process's
    device; the load itself is stopped there (no bitsandbytes here)."""
    import prefixdpo.core.models
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    class Loaded(Exception):
        pass

    import prefixdpo.reward.model

    for module in (prefixdpo.core.models, prefixdpo.reward.model):
        monkeypatch.setattr(module, "check_quantization_available", lambda *a: None)
    seen = {}

    def stop(name, **kwargs):
        seen.update(kwargs)
        raise Loaded

    for cls in (AutoModelForCausalLM, AutoModelForSequenceClassification):
        monkeypatch.setattr(cls, "from_pretrained", stop)
    argv = [command, "--model_name_or_path", local.model, "--dataset_name", local.data, "--output_dir",
            str(tmp_path / "o"), "--use_peft", *options]
    with pytest.raises(Loaded):
        main(argv)
    theirs = trl.get_quantization_config(trl_model_config(argv[1:]))
    assert seen["quantization_config"].to_dict() == theirs.to_dict() and seen["device_map"] == {"": 0}
    if "--load_in_4bit" in options:
        q = seen["quantization_config"]
        assert (q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant, q.bnb_4bit_quant_storage,
                q.bnb_4bit_compute_dtype) == ("fp4", True, torch.bfloat16, torch.bfloat16)
    else:
        assert seen["quantization_config"].load_in_8bit


def _refused(capsys, argv) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_quantized_loading_is_refused_in_one_line_where_it_cannot_run(local, tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    base = ["train", "--model", local.model, "--dataset", local.data, "--output_dir", str(out)]
    assert _refused(capsys, [*base, "--use_peft", "--load_in_4bit"]) == (2, [
        "prefixdpo train: error: load_in_4bit needs a CUDA device (bitsandbytes quantizes on the GPU); this "
        "machine has none"])
    assert not out.exists()  # before any work
    if importlib.util.find_spec("bitsandbytes") is None:
        from prefixdpo.core.models import check_quantization_available

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine without bitsandbytes
        with pytest.raises(ConfigError) as info:
            check_quantization_available("load_in_8bit")
        monkeypatch.undo()
        assert str(info.value) == "load_in_8bit needs bitsandbytes, which is not installed (pip install bitsandbytes)"
    assert _refused(capsys, [*base, "--load_in_4bit"]) == (2, [
        "prefixdpo train: error: load_in_4bit needs --use_peft: a quantized base model is frozen, only LoRA "
        "adapters train (QLoRA)"])
    assert _refused(capsys, [*base, "--use_peft", "--load_in_4bit", "--load_in_8bit"])[1] == [
        "prefixdpo train: error: load_in_8bit and load_in_4bit: use one precision for the base model, not both"]


def test_the_python_api_reads_no_held_out_split_from_a_training_dataset(local, tmp_path):
    """dataset_test_split is the commands' (TRL's scripts'): a trainer given a training file and an evaluation
    file under eval_strategy steps reads each as given, no 'test' split of the training file."""
    from prefixdpo import PrefixDPOTrainer
    from prefixdpo.dpo.config import data_options

    config = _small_config(tmp_path, eval_strategy="steps", eval_steps=1)
    assert data_options(config).eval_split is None and data_options(config, DataArguments()).eval_split == "test"
    trainer = PrefixDPOTrainer(model=local.model, args=config, train_dataset=f"{local.data}/train.jsonl",
                               eval_dataset=f"{local.data}/test.jsonl")
    assert (len(trainer.train_dataset), len(trainer.eval_dataset)) == (16, 6)


def test_the_reward_python_api_reads_no_held_out_split_from_a_training_dataset(local, tmp_path):
    from prefixdpo import PrefixRewardConfig, PrefixRewardTrainer
    from prefixdpo.reward.config import reward_data_options

    config = PrefixRewardConfig(output_dir=str(tmp_path / "rm"), eval_strategy="steps", eval_steps=1, max_steps=1,
                                use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)
    assert reward_data_options(config).eval_split is None
    assert reward_data_options(config, RewardDataArguments()).eval_split == "test"
    trainer = PrefixRewardTrainer(model=local.model, args=config, train_dataset=f"{local.data}/train.jsonl",
                                  eval_dataset=f"{local.data}/validation.jsonl")
    assert (len(trainer.train_dataset), len(trainer.eval_dataset)) == (16, 8)


def test_dataset_config_reaches_load_dataset(local, monkeypatch):
    """A Hub dataset's configuration goes to `datasets.load_dataset` (as TRL's script passes `name=`); on a local
    folder it changes nothing, and a warning line says so."""
    import datasets
    from transformers import AutoTokenizer

    from prefixdpo.data.prepare import prepare_examples
    from prefixdpo.dpo.config import data_options
    from prefixdpo.training.options import script_options_without_effect

    records = [json.loads(line) for line in Path(local.data, "train.jsonl").read_text().splitlines()]
    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(records[:5])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    config, _, data = parse_train_args(["--dataset_name", "some-org/prefs", "--dataset_config", "pairs"])
    prepared = prepare_examples(data.dataset_name, AutoTokenizer.from_pretrained(local.model),
                                data_options(config, data))
    assert calls == [("some-org/prefs", "pairs", "train")] and len(prepared.examples) == 5
    config, _, data = parse_train_args(["--dataset_name", local.data, "--dataset_config", "pairs"])
    assert script_options_without_effect(config, data) == [
        f"dataset_config='pairs' has no effect: {local.data} is a local file or folder (a configuration names a "
        "subset of a Hub dataset)"]


def test_readme_lora_examples_use_trls_flags():
    """Item 4: the documented commands (README and docs/) that set LoRA options also pass --use_peft (the old
    `--lora_r` alone spelling is gone from the examples; tests/test_bad_inputs.py checks its one warning line)."""
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    command = re.compile(r"\s*prefixdpo (train|reward|grpo|rloo)\b")
    commands = [line for page in pages for line in page.read_text().splitlines() if command.match(line)]
    with_lora = [line.split("#")[0] for line in commands if "--lora_" in line.split("#")[0]]
    assert len(with_lora) >= 3 and all("--use_peft" in line for line in with_lora), with_lora


def test_dataset_streaming_is_refused_in_one_line(local, tmp_path, capsys):
    import datasets

    from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer
    from prefixdpo.data.loading import STREAMING_REFUSED

    code, err = _refused(capsys, ["train", "--model", local.model, "--dataset", local.data, "--dataset_streaming",
                                  "--output_dir", str(tmp_path / "o")])
    assert code == 2 and err == [f"prefixdpo train: error: dataset_streaming is not supported: {STREAMING_REFUSED}"]
    assert "needs the whole split" in STREAMING_REFUSED and not (tmp_path / "o").exists()
    # an IterableDataset given to the trainer is refused the same way, never read whole
    streamed = datasets.Dataset.from_list([json.loads(x) for x in Path(local.data, "train.jsonl").read_text()
                                           .splitlines()]).to_iterable_dataset()
    from transformers import AutoTokenizer

    with pytest.raises(UserError, match=r"^a streamed dataset \(IterableDataset\): prefixdpo plans each epoch"):
        PrefixDPOTrainer(model=tiny_model("llama"), args=PrefixDPOConfig(output_dir=str(tmp_path / "o2")),
                         train_dataset=streamed, processing_class=AutoTokenizer.from_pretrained(local.model))


# ------------------------------------------------------------------------ TRL's own commands, run unchanged


def usage_blocks(script_path: str) -> dict[str, list[str]]:
    """{title: argv} of every ```bash block in a TRL script's docstring (continuation lines joined)."""
    text = Path(script_path).read_text()
    doc = text[text.index('"""') + 3:]
    doc = doc[:doc.index('"""')]
    blocks = {}
    for title, body in re.findall(r"# ([^\n]+?):?\n```bash\n(.*?)```", doc, re.S):
        blocks[title.strip()] = shlex.split(body.replace("\\\n", " "))
    return blocks


# TRL's reward usage blocks: trl 1.16's scripts/reward.py has no docstring; these are the blocks of the script it
# replaced (examples/scripts/reward_modeling.py), and TRL's CLI docs add `--lora_task_type SEQ_CLS` to the LoRA one.
REWARD_BLOCKS = {
    "Full training": """python examples/scripts/reward_modeling.py \\
    --model_name_or_path Qwen/Qwen2-0.5B-Instruct \\
    --dataset_name trl-lib/ultrafeedback_binarized \\
    --output_dir Qwen2-0.5B-Reward \\
    --per_device_train_batch_size 8 \\
    --num_train_epochs 1 \\
    --gradient_checkpointing True \\
    --learning_rate 1.0e-5 \\
    --logging_steps 25 \\
    --eval_strategy steps \\
    --eval_steps 50 \\
    --max_length 2048""",
    "LoRA": """python examples/scripts/reward_modeling.py \\
    --model_name_or_path Qwen/Qwen2-0.5B-Instruct \\
    --dataset_name trl-lib/ultrafeedback_binarized \\
    --output_dir Qwen2-0.5B-Reward-LoRA \\
    --per_device_train_batch_size 8 \\
    --num_train_epochs 1 \\
    --gradient_checkpointing True \\
    --learning_rate 1.0e-4 \\
    --logging_steps 25 \\
    --eval_strategy steps \\
    --eval_steps 50 \\
    --max_length 2048 \\
    --use_peft \\
    --lora_r 32 \\
    --lora_alpha 16""",
}


def localised(argv: list[str], command: str, local, steps: int | None = None) -> list[str]:
    """`python SCRIPT OPTIONS` -> `COMMAND OPTIONS`, the Hub model and dataset replaced by the local ones and, where
    the block sets --max_steps, a few steps; nothing else changes."""
    assert argv[0] == "python" and argv[1].endswith(".py")
    out = [command, *argv[2:]]
    for option, value in (("--model_name_or_path", local.model), ("--dataset_name", local.data),
                          ("--max_steps", str(steps))):
        if option in out:
            out[out.index(option) + 1] = value
    return out


def dpo_blocks() -> dict[str, list[str]]:
    return usage_blocks(importlib.util.find_spec("trl.scripts.dpo").origin)


def test_trls_dpo_script_has_the_blocks_run_here():
    blocks = dpo_blocks()
    assert set(blocks) == {"Full training", "LoRA"}
    assert blocks["LoRA"][-5:] == ["--use_peft", "--lora_r", "32", "--lora_alpha", "16"]


def _adapter_only(out: Path, base_model: str, trainer) -> None:
    """The folder holds an adapter, not a model; the base weights in it are the starting ones; the adapter moved."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    auto = AutoModelForSequenceClassification if trainer.model.peft_config["default"].task_type == "SEQ_CLS" \
        else AutoModelForCausalLM
    kwargs = {"num_labels": 1} if auto is AutoModelForSequenceClassification else {}
    original = auto.from_pretrained(base_model, **kwargs).state_dict()
    for name, p in trainer.model.named_parameters():
        if not p.requires_grad:
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            if key in original:
                assert torch.equal(p.detach().cpu(), original[key]), name  # base weights unchanged
    saved = PeftModel.from_pretrained(auto.from_pretrained(base_model, **kwargs), str(out))
    moved = [n for n, p in saved.named_parameters() if "lora_B" in n and p.abs().max() > 0]
    assert moved  # lora_B starts at zero: the saved adapter trained


@pytest.mark.parametrize("block", ["Full training", "LoRA"])
def test_trls_dpo_usage_blocks_run_unchanged(local, tmp_path, monkeypatch, block):
    argv = localised(dpo_blocks()[block], "train", local, steps=1)  # 8 micro-batches (batch 2, accumulation 8)
    monkeypatch.chdir(tmp_path)  # --output_dir Qwen2-0.5B-DPO is relative, as in TRL's block
    code, trainer, out, err = run_command(monkeypatch, argv)
    assert code == 0, err
    assert trainer.state.global_step == 1 and "Model saved to" in out
    assert "Held-out reward accuracy" in out  # --eval_strategy steps: the test split was read
    assert 0 < next(h["train_loss"] for h in trainer.state.log_history if "train_loss" in h) < 1  # ln 2 at start
    folder = tmp_path / "Qwen2-0.5B-DPO"
    if block == "LoRA":
        theirs = trl.get_peft_config(trl_model_config(argv[1:]))
        assert lora_fields(trainer.given_peft_config) == lora_fields(theirs)
        assert (theirs.r, theirs.lora_alpha) == (32, 16)
        _adapter_only(folder, local.model, trainer)
    else:
        assert (folder / "model.safetensors").is_file() and not (folder / "adapter_config.json").exists()


@pytest.mark.parametrize("block", ["Full training", "LoRA", "LoRA, TRL's docs' spelling"])
def test_trls_reward_usage_blocks_run_unchanged(local, tmp_path, monkeypatch, block):
    """The script's blocks, and its LoRA block as TRL's docs spell it (`--lora_task_type SEQ_CLS` added): both
    build what TRL builds from the docs' spelling."""
    text = REWARD_BLOCKS[block.split(",")[0]]
    docs = ["--lora_task_type", "SEQ_CLS"] if "docs" in block else []
    argv = localised(shlex.split(text.replace("\\\n", " ")) + docs, "reward", local)
    monkeypatch.chdir(tmp_path)
    code, trainer, out, err = run_command(monkeypatch, argv)
    assert code == 0, err
    assert trainer.state.global_step == 2 and "Held-out pairwise accuracy" in out  # 16 records, batch 8, 1 epoch
    folder = tmp_path / argv[argv.index("--output_dir") + 1]
    if block.startswith("LoRA"):
        with_task = trl.get_peft_config(trl_model_config([*argv[1:], "--lora_task_type", "SEQ_CLS"]))
        assert lora_fields(trainer.given_peft_config) == lora_fields(with_task)  # what TRL's docs' command builds
        _adapter_only(folder, local.model, trainer)
    else:
        assert (folder / "model.safetensors").is_file()


# ------------------------------------------------------------- rsLoRA, DoRA, modules to save: what trains, as TRL


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _scalings(model) -> dict[str, float]:
    return {n: m.scaling["default"] for n, m in model.named_modules()
            if isinstance(getattr(m, "scaling", None), dict)}  # LoRA layers (a rotary embedding has a float)


@pytest.mark.parametrize("flags", [["--use_rslora"], ["--use_dora"], ["--lora_modules_to_save", "lm_head"]],
                         ids=["rslora", "dora", "modules_to_save"])
def test_rslora_dora_and_modules_to_save_change_what_trains_as_in_trl(tmp_path, flags):
    import copy

    from peft import get_peft_model

    from prefixdpo import PrefixDPOTrainer

    _, plain_args, _ = parse_train_args(["--use_peft"])
    _, model_args, _ = parse_train_args(["--use_peft", *flags])
    ours = model_args.peft_config()
    theirs = trl.get_peft_config(trl_model_config(["--use_peft", *flags]))
    assert lora_fields(ours) == lora_fields(theirs) != lora_fields(plain_args.peft_config())
    start = tiny_model("llama")
    trl_model = get_peft_model(copy.deepcopy(start), theirs)  # the PEFT model TRL's trainer builds
    plain = get_peft_model(copy.deepcopy(start), plain_args.peft_config())
    trainer = PrefixDPOTrainer(model=copy.deepcopy(start), args=_small_config(tmp_path),
                               train_dataset=make_examples(8), peft_config=ours)
    assert _trainable(trainer.model) == _trainable(trl_model) and _scalings(trainer.model) == _scalings(trl_model)
    assert (_trainable(trainer.model), _scalings(trainer.model)) != (_trainable(plain), _scalings(plain))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    new = _trainable(trainer.model) - _trainable(plain)  # DoRA's magnitudes, lm_head's trainable copy
    for name in new:
        assert not torch.equal(after[name].detach(), before[name]), name  # they train
    frozen = [n for n in before if n not in _trainable(trainer.model)]
    assert all(torch.equal(after[n].detach(), before[n]) for n in frozen)  # the base does not
    if flags == ["--use_rslora"]:
        assert set(_scalings(trainer.model).values()) == {32 / 16 ** 0.5}  # alpha / sqrt(r), not alpha / r = 2
