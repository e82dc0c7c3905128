"""TRL 1.16's `ModelConfig` and `GRPOScriptArguments` / `RLOOScriptArguments` on `prefixdpo grpo` / `rloo`, as
TRL's `trl grpo` / `trl rloo` scripts parse them (issue 21, for the group-RL commands).

- Every field of TRL's `ModelConfig`, `ScriptArguments` and its two scripts' argument classes is ours with TRL's
  type and default (the walk of tests/test_trl_model_config.py), and `GROUP_LANDS` names, for each, the test here
  that shows its effect on a group command.
- The model options reach from_pretrained of the policy, its tokenizer, and (through TRL's `model_init_kwargs`, as
  TRL's script sets them) TRL's reference and a reward model by name; LoRA is exactly `--use_peft`, with the
  PEFT config TRL's `get_peft_config` builds; `--use_peft` runs save an adapter and leave the base weights alone.

A tiny Llama over the tiny tokenizer (no downloads); about 15 s on 2 busy cores (one 2-step run, the rest build
the trainer and return).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_trl_model_config import HALF, HALF_NAME, _differences, lora_fields, spy_loads, trl_model_config

from prefixdpo.cli import main
from prefixdpo.errors import ConfigError
from prefixdpo.grpo import PrefixGRPOConfig, PrefixRLOOConfig
from prefixdpo.commands.grpo import parse_group_args
from prefixdpo.grpo.config import GROUP_STREAMING_REFUSED, GroupModelArguments, GroupScriptArguments

trl = pytest.importorskip("trl")
pytest.importorskip("peft")

REWARD = "prefixdpo_tools.demo_grpo:vowel_share"


def test_trls_model_config_and_script_arguments_are_ours():
    assert not _differences(trl.ModelConfig, GroupModelArguments)
    assert not _differences(trl.ScriptArguments, GroupScriptArguments)


@pytest.mark.parametrize("script", ["grpo", "rloo"])
def test_trls_group_script_arguments_are_ours(script):
    """`trl grpo` parses GRPOScriptArguments, `trl rloo` RLOOScriptArguments: ScriptArguments + the rewards."""
    import importlib

    module = importlib.import_module(f"trl.scripts.{script}")
    theirs = getattr(module, f"{script.upper()}ScriptArguments")
    assert {f.name for f in dataclasses.fields(theirs)} >= {"reward_funcs", "reward_model_name_or_path",
                                                            "dataset_streaming", "ignore_bias_buffers"}
    assert not _differences(theirs, GroupScriptArguments)


# Each TRL field -> the test below that shows what it does on a group command.
GROUP_LANDS = {
    **dict.fromkeys(("model_name_or_path", "model_revision", "dtype", "attn_implementation", "use_peft", "lora_r",
                     "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save", "lora_task_type",
                     "use_rslora", "use_dora", "dataset_name", "dataset_train_split", "dataset_test_split",
                     "ignore_bias_buffers", "reward_model_name_or_path", "reward_funcs"),
                    "test_model_and_script_options_land_in_the_group_trainer"),
    "lora_target_parameters": "test_lora_without_use_peft_is_stated_and_target_parameters_reach_peft",
    **dict.fromkeys(("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
                     "bnb_4bit_quant_storage"), "test_quantization_reaches_the_policy_as_trls_config"),
    "dataset_config": "test_dataset_config_reaches_load_dataset",
    "dataset_streaming": "test_dataset_streaming_is_refused_in_one_line_with_the_group_reason",
}


def test_every_trl_field_has_a_test_of_where_it_lands_on_a_group_command():
    from trl.scripts.grpo import GRPOScriptArguments

    trl_fields = {f.name for cls in (trl.ModelConfig, GRPOScriptArguments) for f in dataclasses.fields(cls)}
    assert set(GROUP_LANDS) == trl_fields, set(GROUP_LANDS) ^ trl_fields
    assert all(callable(globals().get(name)) for name in GROUP_LANDS.values())


# ---------------------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture(scope="module")
def group_local(tmp_path_factory):
    """A tiny Llama with its tokenizer, and a prompts folder with train (8), validation (4) and test (4) splits."""
    from grpo_common import INSTRUCTION, saved_tiny_model, tokenizer

    root = tmp_path_factory.mktemp("grpo_trlcli")
    model = saved_tiny_model(root / "model")
    tokenizer().save_pretrained(model)
    data = root / "prompts"
    data.mkdir()
    for split, n in (("train", 8), ("validation", 4), ("test", 4)):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": f"{INSTRUCTION}{split} {i}"}) + "\n"
                                                     for i in range(n)))
    return SimpleNamespace(model=model, data=str(data), root=root)


def run_group_command(mp: pytest.MonkeyPatch, argv: list[str], *, train: bool = True):
    """`prefixdpo ARGV` for grpo/rloo in this process: (exit code, the trainer, stdout, stderr, what TRL's
    create_model_from_path was asked for). train=False: `train` returns at once (the trainer is built by then)."""
    import trl.trainer.grpo_trainer
    import trl.trainer.rloo_trainer

    from prefixdpo.grpo import PrefixGRPOTrainer, PrefixRLOOTrainer

    seen, created = {}, []
    for cls in (PrefixGRPOTrainer, PrefixRLOOTrainer):
        real = cls.train

        def wrapped(self, *args, _real=real, **kwargs):
            seen["trainer"] = self
            return _real(self, *args, **kwargs) if train else None

        mp.setattr(cls, "train", wrapped)
    for module in (trl.trainer.grpo_trainer, trl.trainer.rloo_trainer):
        real_create = module.create_model_from_path

        def create(model_id, _real=real_create, **kwargs):
            created.append((model_id, dict(kwargs)))
            return _real(model_id, **kwargs)

        mp.setattr(module, "create_model_from_path", create)
    out, err = io.StringIO(), io.StringIO()
    torch.set_num_threads(1)  # tiny models; conftest's fixture restores the thread count
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, seen.get("trainer"), out.getvalue(), err.getvalue(), created


def _base(command, group_local, out: Path) -> list[str]:
    return [command, "--model_name_or_path", group_local.model, "--dataset_name", group_local.data,
            "--reward_funcs", REWARD, "--output_dir", str(out), "--num_generations", "4",
            "--per_device_train_batch_size", "4", "--max_completion_length", "8", "--report_to", "none",
            "--disable_tqdm", "true", "--save_strategy", "no"]


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------------------------ where each field lands


GROUP_ARGV = ["--model_revision", "v1", "--dtype", HALF_NAME, "--attn_implementation", "eager",
              "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.1",
              "--lora_target_modules", "q_proj", "k_proj", "--lora_modules_to_save", "lm_head", "--use_rslora",
              "--use_dora", "--dataset_train_split", "validation", "--eval_strategy", "steps", "--eval_steps", "1",
              "--per_device_eval_batch_size", "4", "--ignore_bias_buffers"]


@pytest.mark.parametrize("command", ["grpo", "rloo"])
def test_model_and_script_options_land_in_the_group_trainer(command, group_local, tmp_path, caplog):
    argv = [*_base(command, group_local, tmp_path / "o"), "--reward_model_name_or_path", group_local.model,
            *GROUP_ARGV]
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING):
        loads = spy_loads(mp, bool_buffer=True)
        code, trainer, out, err, created = run_group_command(mp, argv, train=False)
    assert code == 0, err
    # the policy and its tokenizer, as `prefixdpo train` loads them
    policy = next(e for e in loads if e["kind"] == "AutoModelForCausalLM")
    assert policy["name"] == group_local.model and policy["kwargs"]["revision"] == "v1"
    assert policy["attn"] == "eager" and policy["dtype"] == HALF
    tokenizers = [e for e in loads if e["kind"] == "AutoTokenizer"]
    assert [e["kwargs"].get("revision") for e in tokenizers] == ["v1", "v1"]  # the policy's, the reward model's
    # a reward model by name: TRL loads it with model_init_kwargs, which the model options fill as TRL's script
    scorer = next(e for e in loads if e["kind"] == "AutoModelForSequenceClassification")
    assert scorer["name"] == group_local.model and scorer["kwargs"]["revision"] == "v1"
    assert scorer["attn"] == "eager" and scorer["dtype"] == HALF and scorer["kwargs"]["num_labels"] == 1
    assert trainer.reward_funcs[0] is not None and len(trainer.reward_funcs) == 2
    assert not [r for r in caplog.records if "will be ignored" in r.getMessage()]  # they were not
    assert created == []  # LoRA: the reference is the policy with its adapter off, nothing loaded
    # LoRA exactly as TRL's trainer builds it from TRL's own config of the same arguments
    theirs = trl.get_peft_config(trl_model_config(argv[1:]))
    ours = trainer.model.peft_config["default"]
    assert lora_fields(ours) == lora_fields(theirs) | {"target_modules": ours.target_modules}
    assert set(ours.target_modules) == set(theirs.target_modules) == {"q_proj", "k_proj"}
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(group_local.model)
    assert _trainable(trainer.model) == _trainable(get_peft_model(base, copy.deepcopy(theirs)))
    q_proj = trainer.model.get_base_model().model.layers[0].self_attn.q_proj
    assert q_proj.scaling["default"] == pytest.approx(8 / 4 ** 0.5) and q_proj.lora_dropout["default"].p == 0.1
    # the splits: validation to train on, test read because eval_strategy is steps
    assert "Train prompts: Loaded 4 records" in out and "Held-out prompts: Loaded 4 records" in out
    assert [r["prompt"].split()[-2] for r in trainer.eval_dataset] == ["test"] * 4
    assert [r["prompt"].split()[-2] for r in trainer.train_dataset] == ["validation"] * 4
    assert trainer.model._ddp_params_and_buffers_to_ignore == ["base_model.model.model.causal_flags"]


@pytest.mark.parametrize("command, beta", [("grpo", "0.04"), ("rloo", None)])
def test_trls_reference_loads_with_the_model_options(command, beta, group_local, tmp_path):
    """Without LoRA and with beta > 0 (RLOO's default 0.05), TRL loads the reference from the policy's path with
    model_init_kwargs: the revision, dtype and attention the model options name, as under TRL's script."""
    argv = [*_base(command, group_local, tmp_path / "o"), "--model_revision", "v2", "--dtype", HALF_NAME,
            "--attn_implementation", "eager", *(["--beta", beta] if beta else [])]
    with pytest.MonkeyPatch.context() as mp:
        code, trainer, _, err, created = run_group_command(mp, argv, train=False)
    assert code == 0, err
    assert [(Path(m), k["revision"], k["dtype"], k["attn_implementation"]) for m, k in created] == [
        (Path(group_local.model), "v2", HALF_NAME, "eager")]
    assert next(trainer.ref_model.parameters()).dtype == HALF


def test_use_peft_trains_adapters_only(group_local, tmp_path):
    """`--use_peft`: the saved folder holds an adapter (TRL's config, rsLoRA and lm_head's trained copy in it), the
    base weights are the starting ones, the adapter and lm_head moved."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "o"
    argv = [*_base("grpo", group_local, out), "--use_peft", "--use_rslora", "--lora_modules_to_save", "lm_head",
            "--max_steps", "2", "--learning_rate", "1e-2", "--logging_steps", "1", "--seed", "0"]
    with pytest.MonkeyPatch.context() as mp:
        code, trainer, _, err, _ = run_group_command(mp, argv)
    assert code == 0, err
    assert trainer.state.global_step == 2
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    saved = json.loads((out / "adapter_config.json").read_text())
    theirs = trl.get_peft_config(trl_model_config(argv[1:]))
    assert (saved["r"], saved["lora_alpha"], saved["use_rslora"], saved["modules_to_save"]) == (
        theirs.r, theirs.lora_alpha, True, ["lm_head"])
    start = AutoModelForCausalLM.from_pretrained(group_local.model)
    original = start.state_dict()
    for name, p in trainer.model.named_parameters():
        key = name.replace("base_model.model.", "").replace(".base_layer", "")
        if not p.requires_grad and key in original:
            assert torch.equal(p.detach().cpu(), original[key]), name  # base weights unchanged
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(group_local.model), str(out))
    assert any("lora_B" in n and p.abs().max() > 0 for n, p in loaded.named_parameters())  # starts at zero
    head = dict(loaded.named_parameters())["base_model.model.lm_head.modules_to_save.default.weight"]
    assert not torch.equal(head.detach(), original["lm_head.weight"])  # lm_head's copy trained


def test_lora_without_use_peft_is_stated_and_target_parameters_reach_peft(caplog):
    """The old spelling `--lora_r 8` alone changes nothing (as TRL): one warning line; with --use_peft every LoRA
    field, lora_target_parameters included, builds TRL's own config."""
    with caplog.at_level(logging.WARNING, logger="prefixdpo.training.options"):
        _, model_args, _ = parse_group_args(PrefixGRPOConfig, "grpo", ["--lora_r", "8", "--use_cpu", "true"])
    assert model_args.peft_config() is None
    assert [r.getMessage() for r in caplog.records] == [
        "lora_r=8 has no effect without use_peft (full fine-tuning runs; add --use_peft to train LoRA adapters, as "
        "TRL)"]
    flags = ["--use_peft", "--lora_target_parameters", "mlp.gate_proj.weight", "--lora_target_modules", "q_proj"]
    _, model_args, _ = parse_group_args(PrefixRLOOConfig, "rloo", [*flags, "--use_cpu", "true"])
    theirs = trl.get_peft_config(trl_model_config(flags))
    assert lora_fields(model_args.peft_config()) == lora_fields(theirs)
    assert model_args.peft_config().target_parameters == ["mlp.gate_proj.weight"]


def test_quantization_reaches_the_policy_as_trls_config(group_local, tmp_path, monkeypatch):
    """On a machine with CUDA and bitsandbytes (injected: the check passes), the policy is loaded with TRL's
    `get_quantization_config` of the same arguments on this process's device; the load is stopped there."""
    import prefixdpo.core.models
    from transformers import AutoModelForCausalLM

    class Loaded(Exception):
        pass

    monkeypatch.setattr(prefixdpo.core.models, "check_quantization_available", lambda *a: None)
    seen = {}

    def stop(name, **kwargs):
        seen.update(kwargs)
        raise Loaded

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", stop)
    argv = [*_base("grpo", group_local, tmp_path / "o"), "--use_peft", "--load_in_4bit", "--bnb_4bit_quant_type",
            "fp4", "--use_bnb_nested_quant", "--bnb_4bit_quant_storage", "bfloat16", "--dtype", "bfloat16"]
    with pytest.raises(Loaded):
        main(argv)
    theirs = trl.get_quantization_config(trl_model_config(argv[1:]))
    assert seen["quantization_config"].to_dict() == theirs.to_dict() and seen["device_map"] == {"": 0}
    assert seen["quantization_config"].bnb_4bit_quant_type == "fp4"


def test_dataset_config_reaches_load_dataset(group_local, tmp_path, monkeypatch):
    """A Hub dataset's configuration goes to `datasets.load_dataset`, as TRL's script passes `name=`."""
    import datasets
    from transformers import AutoModelForCausalLM

    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list([{"prompt": f"question {i}"} for i in range(4)])

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", stop)
    argv = _base("grpo", group_local, tmp_path / "o")
    argv[argv.index("--dataset_name") + 1] = "some-org/prompts"
    with pytest.raises(Loaded):
        main([*argv, "--dataset_config", "math", "--dataset_train_split", "hard"])
    assert calls == [("some-org/prompts", "math", "hard")]


@pytest.mark.parametrize("command", ["grpo", "rloo"])
def test_dataset_streaming_is_refused_in_one_line_with_the_group_reason(command, group_local, tmp_path, capsys):
    code = main([*_base(command, group_local, tmp_path / "o"), "--dataset_streaming"])
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [
        f"prefixdpo {command}: error: dataset_streaming is not supported: {GROUP_STREAMING_REFUSED}"]
    assert not (tmp_path / "o").exists()  # before any work
    with pytest.raises(ConfigError, match="check every prompt record before the first step"):
        GroupScriptArguments(dataset_streaming=True)
