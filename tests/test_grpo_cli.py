"""`prefixdpo grpo` / `prefixdpo rloo`: TRL's config fields with TRL's names and defaults, every option the help
prints parses, YAML + command line, the dataset / reward / LoRA / resume options on a given model and dataset,
bad input as one line, and the embedded default learning its reward.

Measured on the embedded default (GRPO, 40 steps, ~20 s on 2 cores with one torch thread): the reward's mean
over the first 5 steps 0.278, over the last 5 steps 0.935; prefix sharing ran 76% fewer tokens than TRL's rows.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from test_config import _help_options, _value_for

from prefixdpo.cli import main
from prefixdpo.commands.grpo import RECIPE as GRPO
from prefixdpo.commands.grpo import parse_group_args
from prefixdpo.commands.rloo import RECIPE as RLOO
from prefixdpo.grpo import PrefixGRPOConfig, PrefixRLOOConfig
from prefixdpo.grpo.config import group_options
from prefixdpo.commands.options import OptionParser


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("ours, theirs", [(PrefixGRPOConfig, "GRPOConfig"), (PrefixRLOOConfig, "RLOOConfig")])
def test_every_trl_field_is_ours_with_trls_default(ours, theirs):
    import trl

    trl_fields = dataclasses.fields(getattr(trl, theirs))
    assert len(trl_fields) > 150
    mine = {f.name: f for f in dataclasses.fields(ours)}
    assert [f.name for f in trl_fields if f.name not in mine or _default(mine[f.name]) != _default(f)] == []
    assert {"prefix_sharing", "packing", "pack_length", "attention"} <= mine.keys() - {f.name for f in trl_fields}


@pytest.mark.parametrize("command, config_class", [("grpo", PrefixGRPOConfig), ("rloo", PrefixRLOOConfig)])
def test_every_option_the_help_prints_parses(command, config_class, capsys):
    parser = OptionParser(group_options(config_class), **{"grpo": GRPO, "rloo": RLOO}[command].parser_kwargs())
    assert main([command, "--help"]) == 0
    options = _help_options(capsys.readouterr().out)
    assert len(options) > 250
    for spelled in ("--model", "--dataset", "--reward_funcs", "--num_generations", "--beta", "--lora_r",
                    "--prefix_sharing", "--no_packing", "--pack_length", "--attention", "--resume_from_checkpoint"):
        assert spelled in options, spelled
    for option in options:
        if option not in ("-h", "--help"):
            namespace, rest = parser.parse_known_args([option, *_value_for(parser._option_string_actions[option])])
            assert rest == [], option


def test_trl_yaml_means_what_trl_reads_and_the_command_line_wins(tmp_path):
    yaml = tmp_path / "grpo.yaml"
    yaml.write_text("beta: 0.04\nloss_type: dr_grpo\nnum_generations: 4\nepsilon_high: 0.28\nuse_cpu: true\n"
                    "reward_funcs: think_format_reward\nmax_completion_length: 64\npacking: false\n")
    config, model_args, script = parse_group_args(PrefixGRPOConfig, "grpo", [str(yaml), "--beta", "0.1",
                                                                           "--model", "m", "--lora-r", "8"])
    assert (config.beta, config.loss_type, config.num_generations, config.epsilon_high) == (0.1, "dr_grpo", 4, 0.28)
    assert (config.max_completion_length, config.packing, config.prefix_sharing) == (64, False, True)
    assert script.reward_funcs == ["think_format_reward"] and model_args.lora_r == 8
    assert config.bf16 is False  # TRL would turn bf16 on here and TrainingArguments would refuse it on a CPU


def _error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len([x for x in lines if "error" in x]) == 1
    return lines[-1]


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["grpo", "--beta_typo", "1"]) == 2
    line = _error_line(capsys)
    assert "--beta_typo" in line and "prefixdpo grpo --help" in line
    from grpo_common import saved_tiny_model

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hello"}\n{"question": "no prompt here"}\n')
    base = ["grpo", "--model", saved_tiny_model(tmp_path / "m"), "--dataset", str(data), "--output-dir",
            str(tmp_path / "o"), "--max_steps", "1"]
    assert main(base + ["--reward_funcs", "prefixdpo_tools.demo_grpo:vowel_share"]) == 2
    assert "record 1: no 'prompt' field (fields: question)" in _error_line(capsys)
    assert main(base + ["--reward_funcs", "no_such_reward"]) == 2
    assert "no_such_reward" in _error_line(capsys)
    assert main(base + ["--invalid", "skip"]) == 2  # records fine now, but no reward named
    assert "no reward" in _error_line(capsys)


@pytest.mark.parametrize("command, completion, advice", [
    ("grpo", 16, "set --max_completion_length 7 or less, or shorten its prompt (TRL truncates no prompt)"),
    ("rloo", 8, "shorten or remove the prompts of 64 tokens or more (TRL truncates no prompt)"),
])
def test_a_prompt_past_the_models_positions_is_refused_in_one_line(command, completion, advice, tmp_path, capsys):
    """TRL 1.16 neither truncates nor drops a long prompt: it would generate and train past the model's 64
    positions (exit 0, "Model saved"). Refused before any work, naming the source record (record 0 skipped: row 1
    is record 2) with train's check (`core.fit.refuse_over_limit`)."""
    from grpo_common import saved_tiny_model, tokenizer

    model_dir = saved_tiny_model(tmp_path / "model", max_position_embeddings=64)
    tokenizer().save_pretrained(model_dir)
    long_prompt = "long words " * {"grpo": 8, "rloo": 40}[command]
    records = [{"question": "no prompt"}, {"prompt": "hello"}, {"prompt": long_prompt}, {"prompt": long_prompt}]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    argv = [command, "--model", model_dir, "--dataset", str(data), "--invalid", "skip", "--reward_funcs",
            "prefixdpo_tools.demo_grpo:vowel_share", "--num_generations", "2", "--per_device_train_batch_size", "2",
            "--max_completion_length", str(completion), "--max_steps", "1", "--output-dir", str(out)]
    assert main(argv) == 2
    prompt = {"grpo": 57, "rloo": 281}[command]
    assert _error_line(capsys).endswith(
        f"record 2: its prompt ({prompt} tokens) + max_completion_length ({completion}) is {prompt + completion} "
        f"tokens, more than the 64 positions of LlamaForCausalLM (max_position_embeddings) (1 more records are over "
        f"too): {advice}")
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_prompt_lengths_are_trls():
    """The check counts a prompt's tokens as TRL's `_tokenize_prompts` makes them (text and messages; GRPO's and
    RLOO's)."""
    from types import SimpleNamespace

    from trl import GRPOTrainer, RLOOTrainer

    from grpo_common import tokenizer
    from prefixdpo.grpo.prompt_fit import prompt_lengths

    tok = tokenizer()
    texts = ["hello there", "the quick brown fox " * 5]
    messages = [[{"role": "user", "content": text}] for text in texts]
    for trl_class in (GRPOTrainer, RLOOTrainer):
        trainer = SimpleNamespace(processing_class=tok, chat_template_kwargs={}, tools=None, chat_template=None,
                                  _is_vlm=False, environment_factories=None)
        for prompts in (texts, messages):
            assert prompt_lengths(trainer, prompts) == [len(ids) for ids in
                                                        trl_class._tokenize_prompts(trainer, prompts)[0]]


def _run_cli(argv, capsys) -> str:
    torch.set_num_threads(1)  # tiny models; conftest's fixture restores the thread count
    assert main(argv) == 0
    return capsys.readouterr().out


def test_given_model_dataset_rewards_lora_and_resume(tmp_path, capsys, monkeypatch):
    """A model and a conversational dataset by path, a reward from TRL's registry and one from a user module (fed
    the dataset's extra field), LoRA with the adapter-off reference (beta > 0), a checkpoint, and a resume."""
    from grpo_common import INSTRUCTION, saved_tiny_model, tokenizer

    model_dir = saved_tiny_model(tmp_path / "model")
    tokenizer().save_pretrained(model_dir)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{INSTRUCTION}q{i}"}], "target": "e"})
                            + "\n" for i in range(8)))
    (tmp_path / "my_rewards.py").write_text(
        "def target_share(completions, target, **kwargs):\n"
        "    texts = [c[0]['content'] for c in completions]\n"
        "    return [sum(c == t for c in text) / max(len(text), 1) for text, t in zip(texts, target)]\n")
    monkeypatch.chdir(tmp_path)  # TRL's rule: module:function is looked up in the current folder first
    out = tmp_path / "run"
    common = ["--model", model_dir, "--dataset", str(data), "--reward_funcs", "think_format_reward",
              "my_rewards:target_share", "--use_peft", "--lora_r", "4", "--beta", "0.04", "--num_generations", "4",
              "--per_device_train_batch_size", "4", "--max_completion_length", "8", "--learning_rate", "1e-2",
              "--output-dir", str(out), "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1",
              "--disable_tqdm", "true", "--report_to", "none"]
    stdout = _run_cli(["grpo", *common, "--max_steps", "1"], capsys)
    assert "Loaded 8 records, kept 8 prompts." in stdout
    assert float(re.search(r"tokens saved by prefix sharing: ([\d.]+)%", stdout).group(1)) > 0
    assert (out / "checkpoint-1").is_dir() and (out / "adapter_model.safetensors").is_file()
    stdout = _run_cli(["grpo", *common, "--max_steps", "2", "--resume_from_checkpoint", "latest"], capsys)
    steps = [int(m) for m in re.findall(r"^step\s+(\d+):", stdout, flags=re.M)]
    assert steps == [2]  # resumed after step 1: only step 2 ran
    config = json.loads((out / "checkpoint-2" / "adapter_config.json").read_text())
    assert config["r"] == 4


def test_a_prompt_over_max_tokens_per_pass_is_said_once_and_counted(tmp_path, capsys, caplog):
    """The budget splits the completions after a prompt into chunks, not the prompt: a prompt longer than it runs
    in one pass (finding 9 of issue 35: exceeded silently). Said once at the first such line, counted at the end."""
    from grpo_common import prompt_dataset, saved_tiny_model, tokenizer

    model_dir = saved_tiny_model(tmp_path / "model")
    tokenizer().save_pretrained(model_dir)
    data = tmp_path / "prompts.jsonl"
    prompt_dataset(4).to_json(str(data))
    argv = ["grpo", "--model", model_dir, "--dataset", str(data), "--reward_funcs",
            "prefixdpo_tools.demo_grpo:vowel_share", "--num_generations", "4", "--per_device_train_batch_size", "4",
            "--max_completion_length", "8", "--max_steps", "1", "--prefix_reuse", "true", "--max_tokens_per_pass",
            "16", "--output-dir", str(tmp_path / "run"), "--disable_tqdm", "true", "--report_to", "none"]
    with caplog.at_level("WARNING", logger="prefixdpo.core.attention.reuse_plan"):
        stdout = _run_cli(argv, capsys)
    said = [r.getMessage() for r in caplog.records if "max_tokens_per_pass=16" in r.getMessage()]
    assert len(said) == 1 and re.match(r"prefix reuse: a shared prefix \(prompt\) of \d+ tokens runs in one pass, "
                                       r"\d+ over max_tokens_per_pass=16", said[0]), said
    assert re.search(r"^Prefix reuse: \d+ lines ran a pass over max_tokens_per_pass=16 \(the largest: a shared "
                     r"prefix \(prompt\) of \d+ tokens, \d+ over;", stdout, re.M), stdout


@pytest.mark.parametrize("command", ["grpo"])
def test_embedded_default_learns_its_reward(command, tmp_path, capsys):
    out = tmp_path / "run"
    stdout = _run_cli([command, "--output-dir", str(out), "--disable-tqdm", "true"], capsys)
    rewards = [float(x) for x in re.findall(r"^step\s+\d+: reward ([\d.]+)", stdout, flags=re.M)]
    assert len(rewards) == 8  # 40 steps, logged every 5 (each a mean over its 5 steps)
    first, last = rewards[0], rewards[-1]
    print(f"REPORT {command} embedded default: reward over the first 5 steps {first:.3f}, over the last 5 {last:.3f}")
    assert last > first + 0.2, stdout
    saved = float(re.search(r"ran ([\d.]+)% fewer tokens", stdout).group(1))
    assert saved > 50.0
    assert "prefixdpo" not in (out / "config.json").read_text()  # the export names stock attention


def test_rloo_command_trains_on_a_given_model(tmp_path, capsys):
    from grpo_common import prompt_dataset, saved_tiny_model, tokenizer

    model_dir = saved_tiny_model(tmp_path / "model")
    tokenizer().save_pretrained(model_dir)
    data = tmp_path / "prompts.jsonl"
    prompt_dataset(8).to_json(str(data))
    stdout = _run_cli(["rloo", "--model", model_dir, "--dataset", str(data), "--reward_funcs",
                       "prefixdpo_tools.demo_grpo:vowel_share", "--num_generations", "4",
                       "--per_device_train_batch_size", "4", "--max_completion_length", "8", "--max_steps", "2",
                       "--logging_steps", "1",
                       "--output-dir", str(tmp_path / "run"), "--disable_tqdm", "true", "--report_to", "none"],
                      capsys)
    assert len(re.findall(r"^step\s+\d+: reward [\d.]+  \(tokens saved by prefix sharing: [1-9]", stdout, re.M)) == 2
    assert (tmp_path / "run" / "model.safetensors").is_file()
