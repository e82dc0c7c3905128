"""The reward commands: `prefixdpo reward` on a given model and dataset, bad input as one line (as
`prefixdpo train`), `prefixdpo verify --task reward`, `prefixdpo bench --task reward` and its ideal."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_model
from prefixdpo.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny causal LM (reward models start from one, as TRL's do) with the tiny tokenizer, and records."""
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
    from test_trl_parity import parity_records

    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(path / "model")
    tiny_model("qwen2", vocab_size=len(tokenizer)).save_pretrained(path / "model")
    records = [{**r, "margin": 0.5} for r in parity_records(8)]
    (path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("tree", [False, True], ids=["packed", "prefix-tree"])
def test_reward_trains_a_given_model_and_saves_a_stock_reward_model(saved, tmp_path, capsys, caplog, tree):
    import logging

    from transformers import AutoModelForSequenceClassification

    caplog.set_level(logging.INFO, logger="prefixdpo.data.loader")
    out = tmp_path / "rm"
    code = main(["reward", "--model", str(saved / "model"), "--dataset", str(saved / "data.jsonl"), "--max-steps",
                 "2", "--logging-steps", "1", "--per-device-train-batch-size", "4", "--packing", "--center-rewards-coefficient", "0.01",
                 "--output-dir", str(out), "--disable-tqdm", "true", "--use-cpu",
                 *(["--prefix_tree", "true"] if tree else [])])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "Loaded 8 records, kept 8 examples" in stdout and "last training accuracy" in stdout
    assert ("lines of tries" in caplog.text) == tree  # the loader planned token tries (`TreePlan.summary`)
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.config.num_labels == 1
    assert model.config.pad_token_id is not None and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("record,expected", [
    ({"prompt": "hi", "chosen": " a"}, "record 1: "),  # no rejected: the DPO pipeline's own message
    ({"prompt": "hi", "chosen": " a", "rejected": " b", "margin": "big"}, "record 1: field 'margin' must be a finite"),
])
def test_bad_records_are_one_line_errors_naming_the_record(saved, tmp_path, capsys, record, expected):
    good = {"prompt": "hello", "chosen": " yes", "rejected": " no", "margin": 0.0}
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    assert main(["reward", "--model", str(saved / "model"), "--dataset", str(data), "--output-dir",
                 str(tmp_path / "o"), "--use-cpu"]) == 2
    assert expected in _error_line(capsys)


def test_bad_margins_are_skipped_and_counted_with_invalid_skip(saved, tmp_path):
    from prefixdpo.dpo.config import DataArguments
    from prefixdpo.core.models import load_tokenizer
    from prefixdpo import PrefixRewardConfig
    from prefixdpo.reward.config import reward_data_options
    from prefixdpo.reward.data import reward_examples

    records = [{"prompt": "hello", "chosen": " yes", "rejected": " no", "margin": m} for m in (1.0, None, float("nan"))]
    options = reward_data_options(PrefixRewardConfig(use_cpu=True), DataArguments(invalid="skip"))
    reports: dict = {}
    examples = reward_examples(records, load_tokenizer(saved / "model"), options, "train", reports)
    assert [ex.meta["margin"] for ex in examples] == [1.0]
    assert reports["train"].kept == 1 and reports["train"].skipped_total == 2


def test_reward_options_help_and_unknown_option(capsys):
    assert main(["reward", "--help"]) == 0
    assert "--center_rewards_coefficient" in capsys.readouterr().out
    assert main(["reward", "--beta", "0.1"]) == 2  # a DPO option is not a reward option
    line = _error_line(capsys)
    assert "--beta" in line and "prefixdpo reward --help" in line


def test_verify_task_reward_passes_and_catches_a_broken_layout(saved, capsys):
    assert main(["verify", "--task", "reward", "--model", str(saved / "model")]) == 0
    out = capsys.readouterr().out
    assert "max |dscore|" in out and "prefix sharing matches separate passes" in out
    assert sum(line.endswith(" ok") for line in out.splitlines()) == 5  # the tree row too
    assert main(["verify", "--task", "reward", "--model", str(saved / "model"), "--no-restart-positions"]) == 1
    from prefixdpo.commands.verify import TREE_CASE

    tree_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(TREE_CASE))
    assert tree_row.endswith("FAIL")  # a tree line with positions running on through the line is caught


def test_reward_ideal_counts_body_and_attention_only():
    from prefixdpo_tools.bench.reward import reward_ideal_speedup
    from prefixdpo.data.example import Example
    from prefixdpo_tools.bench.flops import ModelShape, ideal_speedup

    shape = ModelShape(hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=1000)
    ex = Example([1] * 10, [[2] * 4, [3] * 6], pairs=[(0, 1)])
    body = 2 * shape.body_params_per_token()
    attention = shape.layers * 4 * shape.heads * shape.head_dim
    standard = body * (14 + 16) + attention * (14 * 15 // 2 + 16 * 17 // 2)
    shared = body * 20 + attention * (55 + 4 * 10 + 10 + 6 * 10 + 21)
    assert reward_ideal_speedup(shape, [ex]) == pytest.approx(standard / shared, rel=1e-12)
    assert reward_ideal_speedup(shape, [ex]) != pytest.approx(ideal_speedup(shape, [ex]))  # DPO counts the head


def test_bench_task_reward_reports_shared_packed_over_paired_packed_with_its_ideal(tmp_path, capsys):
    rc = main(["bench", "--task", "reward", "--quick", "--profiles", "ultrafeedback-k4", "--examples", "2",
               "--per-step", "2", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["task"].startswith("reward model")
    for profile in report["profiles"]:
        assert profile["paper"] is None and profile["flop_split"]["shared"]["lm_head"] == 0.0
        assert profile["ideal"] > 1.0 and profile["speedups"]["shared_packed_vs_paired_packed"]["median"] > 0
    assert "| ultrafeedback-k4 |" in capsys.readouterr().out


def test_multi_response_records_give_every_pair_of_the_policy_and_their_margin(saved):
    from prefixdpo.dpo.config import DataArguments
    from prefixdpo.core.models import load_tokenizer
    from prefixdpo import PrefixRewardConfig
    from prefixdpo.reward.config import reward_data_options
    from prefixdpo.data.loader import pair_margins
    from prefixdpo.reward.data import reward_examples

    records = [{"prompt": "pick one", "completions": [" a", " b", " c"], "scores": [1, 3, 2], "margin": 0.5},
               {"prompt": "another", "completions": [" x", " y"], "scores": [0, 1], "margin": -1}]
    options = reward_data_options(PrefixRewardConfig(use_cpu=True), DataArguments(pairs_policy="best_vs_each"))

    examples = reward_examples(records, load_tokenizer(saved / "model"), options, "train", {})
    assert [sorted(ex.pairs) for ex in examples] == [[(1, 0), (1, 2)], [(1, 0)]]  # the best against each other
    assert pair_margins([examples[1], examples[0]]).tolist() == [-1.0, 0.5, 0.5]  # batch order
