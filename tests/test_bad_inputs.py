"""Bad input is refused before any training work: one line on stderr, exit code 2, no traceback, and the
output_dir untouched (not created when absent; byte for byte the same when it holds another run).

Each case runs the real command line in-process (`prefixdpo.cli.main`) on a small model built locally
(`prefixdpo_tools.demo`, no downloads). Then the fit check (`prefixdpo.core.fit`) on its own: a row exactly at the
model's positions passes, one token over is refused naming the record; rope scaling and sliding windows; the
mask-memory estimate against the measured bound. Last, every `--option` that an error message of
prefixdpo advises is a real option of a prefixdpo command.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from prefixdpo.cli import main
from prefixdpo.data.example import Example
from prefixdpo_tools.demo import DemoSpec, build_demo

SPEC = DemoSpec(num_train=24, num_eval=4, max_position_embeddings=512)
WORDS = "apple river stone cloud tiger piano garden window "


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A small model (512 positions) + tokenizer, its training records, and the same model with 8192 positions."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr must hold exactly what the command writes
    root = tmp_path_factory.mktemp("demo")
    paths = build_demo(root / "base", SPEC)
    long = root / "long-model"
    shutil.copytree(paths.model_dir, long)
    cfg = json.loads((long / "config.json").read_text())
    (long / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 8192}))
    records = [json.loads(line) for line in paths.train_file.read_text().splitlines()]
    return SimpleNamespace(model=str(paths.model_dir), long_model=str(long), records=records)


def write_jsonl(path: Path, records) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def snapshot(folder: Path) -> dict | None:
    """Every file under `folder` with its bytes and modification time; None if it does not exist."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, out: Path, argv: list[str]) -> str:
    """Run `prefixdpo train ARGV --output_dir OUT`: assert exit 2, one stderr line, no traceback, OUT as it was;
    return the message after `prefixdpo train: error: `."""
    before = snapshot(out)
    capsys.readouterr()
    code = main(["train", *argv, "--output_dir", str(out), "--max_steps", "1"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("prefixdpo train: error: "), lines[0]
    assert snapshot(out) == before, "a refused run touched output_dir"
    return lines[0].removeprefix("prefixdpo train: error: ")


# ---- the command line: each bad input, one line, exit 2, nothing written ------------------------------------


def test_folder_of_several_file_types_is_refused_naming_each(tmp_path, demo, capsys):
    write_jsonl(tmp_path / "data" / "a.jsonl", demo.records[:6])
    (tmp_path / "data" / "b.csv").write_text("prompt,chosen,rejected\nhi, yes, no\n")
    msg = refused(capsys, tmp_path / "out", ["--model", demo.model, "--dataset", str(tmp_path / "data")])
    assert msg == (f"{tmp_path / 'data'}: holds data files of 2 types (csv: b.csv; json: a.jsonl); a dataset folder "
                   "is read with one reader, so keep one type in it or give one file as the dataset")


def test_bad_line_in_a_folder_names_the_file_and_line_and_numbers_records_across_files(tmp_path, demo, capsys):
    write_jsonl(tmp_path / "data" / "a.jsonl", demo.records[:3])
    good = json.dumps(demo.records[3])
    (tmp_path / "data" / "b.jsonl").write_text(f"{good}\n\n{{\"prompt\": broken\n{good}\n")
    msg = refused(capsys, tmp_path / "out", ["--model", demo.model, "--dataset", str(tmp_path / "data")])
    # b.jsonl's first record is record 3 (a.jsonl holds 0-2); the blank line is no record; the bad one is line 3
    assert msg == "record 4: b.jsonl line 3 is not valid JSON (Expecting value)"


def test_folder_with_a_bad_line_skips_it_with_invalid_skip(tmp_path, demo):
    """The same reader as a single file: `--invalid skip` counts the bad line instead of failing."""
    from prefixdpo.data.prepare import DataOptions, prepare_examples
    from prefixdpo.core.models import load_tokenizer

    write_jsonl(tmp_path / "data" / "a.jsonl", demo.records[:3])
    (tmp_path / "data" / "b.jsonl").write_text("{oops\n" + json.dumps(demo.records[3]) + "\n")
    report = prepare_examples(str(tmp_path / "data"), load_tokenizer(demo.model), DataOptions(invalid="skip")).report
    assert (report.loaded, report.kept, dict(report.skipped)) == (5, 4, {"bad_json": 1})
    assert report.skip_examples["bad_json"] == "record 3: b.jsonl line 1 is not valid JSON " \
        "(Expecting property name enclosed in double quotes)"


@pytest.mark.parametrize("keep", [[], ["tokenizer_config.json"]], ids=["no_tokenizer_files", "config_only"])
def test_model_folder_without_tokenizer_names_the_folder_and_what_is_missing(tmp_path, demo, capsys, keep):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json", *keep):
        shutil.copy(Path(demo.model) / name, model / name)
    data = write_jsonl(tmp_path / "d.jsonl", demo.records[:4])
    msg = refused(capsys, tmp_path / "out", ["--model", str(model), "--dataset", data])
    found = "tokenizer_config.json but " if keep else ""
    assert msg == (f"{model}: no tokenizer can be loaded from this folder ({found}no vocabulary file: none of "
                   "tokenizer.json, tokenizer.model, vocab.json + merges.txt, vocab.txt); save the model's "
                   "tokenizer into it with tokenizer.save_pretrained")


def test_model_path_that_does_not_exist_says_so(tmp_path, demo, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", demo.records[:4])
    missing = str(tmp_path / "no-such-model")
    msg = refused(capsys, tmp_path / "out", ["--model", missing, "--dataset", data])
    assert msg == f"no such model folder: {missing}"


def test_record_over_the_models_positions_names_it_and_a_max_length(tmp_path, demo, capsys):
    long = dict(demo.records[1], prompt=WORDS * 200)  # ~1600 tokens, the model has 512 positions
    data = write_jsonl(tmp_path / "d.jsonl", [demo.records[0], long, long])
    msg = refused(capsys, tmp_path / "out", ["--model", demo.model, "--dataset", data, "--max_length", "none"])
    assert re.fullmatch(r"record 1: its prompt \+ longest response is \d{4} tokens, more than the 512 positions of "
                        r"LlamaForCausalLM \(max_position_embeddings\) \(1 more records are over too\): "
                        r"set --max_length 512 or less", msg), msg


def test_mask_over_the_memory_bound_names_the_record_and_a_max_length_that_fits(tmp_path, demo, capsys, monkeypatch):
    """The machine's memory is injected as a 64 MiB container limit: the dense masks of two ~3200-token lines
    (~100 MiB) are over half of it. The model has 8192 positions, so only memory can refuse them."""
    import prefixdpo.core.fit

    monkeypatch.setattr(prefixdpo.core.fit, "_cgroup_memory_limit", lambda: 64 * 2**20)
    long = dict(demo.records[1], prompt=WORDS * 200)
    data = write_jsonl(tmp_path / "d.jsonl", [demo.records[0], long])
    argv = ["--model", demo.long_model, "--dataset", data, "--max_length", "none", "--attention", "sdpa"]
    msg = refused(capsys, tmp_path / "out", argv)
    match = re.fullmatch(r"record 1 makes a line of (\d+) tokens: training micro-batches of 2 such lines need about "
                         r"(\d+) MiB for attention=sdpa's mask, more than half of this machine's 64 MiB of "
                         r"memory: set --max_length (\d+) or less, or a smaller --per_device_train_batch_size "
                         r"\(now 8\)", msg)
    assert match, msg
    line, max_length = int(match[1]), int(match[3])
    assert 3000 < line < 4000 and int(match[2]) == round(2 * line * line * 5 / 2**20)
    # the advice is enough and not much too strict: the worst row at that max_length (a one-token prompt and two
    # responses of max_length - 1: a line of 2 x max_length - 1) passes the check, the worst at max_length + 2 fails
    from prefixdpo.core.fit import Batches, check_mask_memory, memory_bound

    def worst(length: int) -> Example:
        return Example((1,), ((5,) * (length - 1), (6,) * (length - 1)), source_index=7)

    batches, bound = Batches("training", "per_device_train_batch_size", 8), memory_bound("cpu")
    check_mask_memory([worst(max_length)] * 2, batches, backend="sdpa", itemsize=4, bound=bound)
    with pytest.raises(prefixdpo.core.fit.DataDoesNotFitError, match="^record 7 makes a line of"):
        check_mask_memory([worst(max_length + 2)] * 2, batches, backend="sdpa", itemsize=4, bound=bound)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--pack_length", "256"], "pack_length=256 has no effect without packing: add --packing true, or leave "
                                   "pack_length out"),
        (["--simpo_gamma", "1.0"], "simpo_gamma=1.0 has no effect: it is a parameter of loss_type simpo, not of "
                                   "sigmoid"),
    ],
    ids=["pack_length_without_packing", "simpo_gamma_without_simpo"],
)
def test_our_options_without_effect_are_refused(tmp_path, demo, capsys, options, message):
    data = write_jsonl(tmp_path / "d.jsonl", demo.records[:4])
    assert refused(capsys, tmp_path / "out", ["--model", demo.model, "--dataset", data, *options]) == message


def test_row_over_an_explicit_pack_length_is_refused_before_training(tmp_path, demo, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", demo.records[:4])
    msg = refused(capsys, tmp_path / "out", ["--model", demo.model, "--dataset", data, "--packing", "true",
                                             "--pack_length", "16"])
    assert re.fullmatch(r"record 0: its row holds \d+ tokens, more than pack_length=16 \(raise pack_length, or "
                        r"lower max_length to truncate or drop long records\)", msg), msg


def test_reward_refuses_pack_length_without_packing_too(tmp_path, demo, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", demo.records[:4])
    code = main(["reward", "--model", demo.model, "--dataset", data, "--output_dir", str(tmp_path / "out"),
                 "--pack_length", "128"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["prefixdpo reward: error: pack_length=128 has no effect without packing: add "
                                 "--packing true, or leave pack_length out"]
    assert not (tmp_path / "out").exists()


def test_trls_options_without_effect_are_stated_not_refused(tmp_path, caplog):
    """TRL accepts these silently, so a TRL YAML with them must still run: one warning line each (also ref_cache_dir,
    which only names a place and which a base config may set for every run)."""
    from prefixdpo import PrefixDPOConfig

    with caplog.at_level(logging.WARNING, logger="prefixdpo.dpo.config"):
        PrefixDPOConfig(output_dir=str(tmp_path), precompute_ref_batch_size=4, discopop_tau=0.1,
                        ref_model_sync_steps=8, ref_cache_dir=str(tmp_path / "refs"))
        PrefixDPOConfig(output_dir=str(tmp_path), loss_type=["simpo"], precompute_ref_log_probs=True)
        PrefixDPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, precompute_ref_batch_size=4,
                        loss_type=["discopop"], discopop_tau=0.1)
        PrefixDPOConfig(output_dir=str(tmp_path), sync_ref_model=True, ref_model_sync_steps=8)
    assert [r.getMessage() for r in caplog.records] == [
        "ref_cache_dir has no effect without precompute_ref_log_probs",
        "precompute_ref_batch_size=4 has no effect without precompute_ref_log_probs",
        "discopop_tau=0.1 has no effect: loss_type is not discopop",
        "ref_model_sync_steps=8 has no effect without sync_ref_model",
        "precompute_ref_log_probs has no effect: loss_type simpo uses no reference model",
    ]  # the last two use every one of them: nothing said


def test_trls_model_and_script_options_without_effect_are_stated_not_refused(tmp_path, caplog):
    """TRL's LoRA options without --use_peft (the old prefixdpo spelling `--lora_r 16` alone), its 4-bit options
    without --load_in_4bit, a test split without evaluation, DDP's buffers without DDP: one warning line each."""
    from prefixdpo.commands.train import parse_train_args
    from prefixdpo.training.options import script_options_without_effect

    with caplog.at_level(logging.WARNING, logger="prefixdpo.training.options"):
        config, _, data = parse_train_args(["--output_dir", str(tmp_path), "--lora_r", "8", "--lora_alpha", "16",
                                            "--use_dora", "--bnb_4bit_quant_type", "fp4", "--dataset_test_split",
                                            "valid", "--ignore_bias_buffers"])
    assert [r.getMessage() for r in caplog.records] == [
        "lora_r=8, lora_alpha=16, use_dora=True have no effect without use_peft (full fine-tuning runs; add "
        "--use_peft to train LoRA adapters, as TRL)",
        "bnb_4bit_quant_type=fp4 has no effect without load_in_4bit (the model is not loaded in 4 bit, as TRL)",
    ]
    assert script_options_without_effect(config, data) == [
        "dataset_test_split='valid' has no effect with eval_strategy 'no' (as TRL): set --eval_strategy steps or "
        "epoch to evaluate on it",
        "ignore_bias_buffers has no effect: only DDP reads it, and this run is one process",
    ]


def test_missing_eos_advises_only_real_options(tmp_path, demo, capsys):
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(demo.model, model)
    tokenizer = AutoTokenizer.from_pretrained(demo.model)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(model)
    data = write_jsonl(tmp_path / "d.jsonl", demo.records[:4])
    msg = refused(capsys, tmp_path / "out", ["--model", str(model), "--dataset", data])
    assert msg.startswith("the tokenizer has no eos_token to end each text response with")
    assert "add_eos" not in msg.replace("DataOptions(add_eos=False)", "")  # only as the Python API's parameter
    assert set(re.findall(r"--[a-z_]+", msg)) == {"--eos_token"} <= command_options()


def test_a_refused_run_leaves_another_runs_output_dir_as_it_was(tmp_path, demo, capsys):
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "checkpoint-5" / "model.safetensors").write_bytes(b"weights of another run")
    (out / "config.json").write_text("{}")
    long = dict(demo.records[1], prompt=WORDS * 200)
    data = write_jsonl(tmp_path / "d.jsonl", [long])
    assert refused(capsys, out, ["--model", demo.model, "--dataset", data, "--max_length", "none"]).startswith(
        "record 0: its prompt + longest response is")


# ---- the fit check on its own ---------------------------------------------------------------------------


def _example(prompt: int, *responses: int, index: int = 0) -> Example:
    return Example(tuple(range(prompt)), tuple((5,) * n for n in responses), source_index=index)


def test_a_row_exactly_at_max_position_embeddings_passes_one_over_fails():
    from conftest import tiny_model

    from prefixdpo.core.fit import DataDoesNotFitError, check_positions

    model = tiny_model("llama", max_position_embeddings=16)
    # positions restart after the prompt: a shared row of 6 + 10 + 9 = 25 tokens only reaches position 15
    check_positions(model, [_example(6, 10, 9, index=0), _example(3, 2, 13, index=1)])
    with pytest.raises(DataDoesNotFitError) as info:
        check_positions(model, [_example(6, 10, 9, index=0), _example(6, 3, 11, index=41)], "eval")
    assert str(info.value) == ("eval: record 41: its prompt + longest response is 17 tokens, more than the 16 "
                               "positions of LlamaForCausalLM (max_position_embeddings): set --max_length 16 or less")


def test_sliding_window_is_checked_for_the_whole_dataset():
    from conftest import tiny_model

    from prefixdpo.core.fit import DataDoesNotFitError, check_positions

    model = tiny_model("mistral", sliding_window=8)  # 512 positions
    check_positions(model, [_example(4, 4, 2)])
    with pytest.raises(DataDoesNotFitError, match=r"^record 3: its prompt \+ longest response is 9 tokens, more "
                                                  r"than the sliding-window attention of MistralForCausalLM "
                                                  r"\(window 8\).*: set --max_length 8 or less$"):
        check_positions(model, [_example(4, 4, 2), _example(4, 5, 2, index=3)])
    # the dense mask slides the window over a shared row (`masks.dense_mask`): only the positions bind there
    check_positions(model, [_example(4, 4, 2), _example(4, 5, 2, index=3)], backend="sdpa")


@pytest.mark.parametrize(
    "config, limit",
    [
        (dict(max_position_embeddings=4096), 4096),
        # YaRN as Qwen2.5 documents it: original x factor beyond max_position_embeddings
        (dict(max_position_embeddings=32768, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}),
         131072),
        # Llama-3.1 style: max_position_embeddings already states the extended length
        (dict(max_position_embeddings=131072, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "rope_theta": 5e5}), 131072),
        (dict(max_position_embeddings=2048, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 1e4}), 4096),
        # dynamic NTK grows with the sequence: no fixed end, not refused
        (dict(max_position_embeddings=2048, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                             "rope_theta": 1e4}), None),
    ],
    ids=["plain", "yarn", "llama3", "linear", "dynamic"],
)
def test_position_limit_follows_rope_scaling(config, limit):
    from transformers import LlamaConfig

    from prefixdpo.core.fit import position_limit

    assert position_limit(SimpleNamespace(config=LlamaConfig(**config))) == limit


def test_position_limit_of_other_configs():
    from transformers import Gemma3TextConfig, GPT2Config

    from prefixdpo.core.fit import position_limit

    assert position_limit(SimpleNamespace(config=GPT2Config(n_positions=300))) == 300  # learned positions
    assert position_limit(SimpleNamespace(config=Gemma3TextConfig(max_position_embeddings=1000))) == 1000  # per-type
    from transformers import MambaConfig

    assert position_limit(SimpleNamespace(config=MambaConfig())) is None  # no position limit stated: not checked


def test_mask_estimate_matches_the_backend_and_the_bound_is_half_the_memory(monkeypatch):
    import os

    import prefixdpo.core.fit
    from prefixdpo.core.fit import mask_bytes, memory_bound

    L = 1000
    assert mask_bytes("sdpa", 2, L, 300, itemsize=4) == 2 * L * L * 5  # bool mask + fp32 copy in SDPA
    assert mask_bytes("sdpa", 2, L, 300, itemsize=2) == 2 * L * L * 4  # building it: four bool [L, L]
    assert mask_bytes("segmented", 2, L, 300, itemsize=4) == int(1.25 * 2 * 300 * L) * 5
    assert mask_bytes("flex", 2, L, 300, 4) == mask_bytes("varlen", 2, L, 300, 4) == 0
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(prefixdpo.core.fit, "_cgroup_memory_limit", lambda: None)
    assert memory_bound("cpu")[0] == total // 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes share the machine's memory
    assert memory_bound("cpu") == (total // 4, f"half of this machine's {total / 2**30:.1f} GiB of memory shared "
                                               "by 2 processes")


def test_packed_lines_over_the_bound_name_the_pack_length_and_suggest_segmented_where_it_fits():
    from prefixdpo.core.fit import Batches, DataDoesNotFitError, check_mask_memory, mask_bytes

    short = [_example(30, 10, 10, index=i) for i in range(64)]  # rows of 50 tokens, sequences of 40
    packed = Batches("training", "per_device_train_batch_size", 2, packing=True, pack_length=4096)
    need = mask_bytes("sdpa", 2, 4096, 40, itemsize=4)  # 160 MiB for the dense masks of two lines
    assert mask_bytes("segmented", 2, 4096, 40, itemsize=4) < 2**21  # segments of 40 tokens: under 2 MiB
    with pytest.raises(DataDoesNotFitError) as info:
        check_mask_memory(short, packed, backend="sdpa", itemsize=4, bound=(need - 1, "a test bound"))
    assert str(info.value) == (
        "pack_length=4096: training micro-batches of 2 such lines need about 160 MiB for attention=sdpa's mask, "
        "more than a test bound: set --pack_length 3968 or less, or a smaller --per_device_train_batch_size "
        "(now 2), or --attention segmented, which masks only each segment")
    check_mask_memory(short, packed, backend="sdpa", itemsize=4, bound=(need, "a test bound"))  # at the bound: ok
    check_mask_memory(short, packed, backend="segmented", itemsize=4, bound=(2**21, "a test bound"))


def test_packed_and_unpacked_longest_lines():
    from prefixdpo.core.fit import Batches, _longest_line

    exs = [_example(10, 5, 5, index=0), _example(50, 30, 20, index=1), _example(5, 2, 2, index=2)]
    assert _longest_line(exs, Batches("t", "b", 4, pad_multiple=8)) == (104, 1)  # 100 rounded up to 8
    assert _longest_line(exs, Batches("t", "b", 4, prefix_sharing=False)) == (150, 1)  # both [prompt][response]
    assert _longest_line(exs, Batches("t", "b", 4, packing=True, pack_length=512)) == (512, 1)
    assert _longest_line(exs, Batches("t", "b", 4, packing=True)) == (128, 1)  # auto: longest rounded to 128


# ---- advice names real options ------------------------------------------------------------------------------


def command_options() -> set[str]:
    """Every option of every prefixdpo command, as `--name` with underscores."""
    from prefixdpo.cli import build_parser
    from prefixdpo.dpo.config import DPO_OPTIONS
    from prefixdpo.commands.options import OptionParser
    from prefixdpo.reward.config import REWARD_OPTIONS

    from prefixdpo.grpo import PrefixGRPOConfig, PrefixRLOOConfig
    from prefixdpo.grpo.config import group_options

    parsers = [OptionParser(DPO_OPTIONS), OptionParser(REWARD_OPTIONS),
               *(OptionParser(group_options(config)) for config in (PrefixGRPOConfig, PrefixRLOOConfig))]
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    parsers += list(sub.choices.values())
    return {s.replace("-", "_").replace("__", "--", 1) for p in parsers for s in p._option_string_actions}


def test_every_option_an_error_message_advises_exists():
    """Scans every string inside a `raise` of src/prefixdpo for `--option`."""
    src = Path(__file__).resolve().parents[1] / "src" / "prefixdpo"
    options = command_options()
    outside = {"--nproc_per_node"}  # torchrun's, named as such
    advised = {}
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise):
                for const in ast.walk(node):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        for opt in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", const.value):
                            advised.setdefault(opt.replace("-", "_").replace("__", "--", 1), f"{path}:{node.lineno}")
    assert len(advised) > 10  # the scan sees the messages
    unknown = {opt: where for opt, where in advised.items() if opt not in options | outside}
    assert not unknown, unknown
