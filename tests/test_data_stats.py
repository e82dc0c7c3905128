"""Length statistics, tokens saved, packing efficiency, FLOP-model speedup, and `prefixdpo inspect`."""

from __future__ import annotations

import json

import pytest

from prefixdpo_tools.bench.flops import ModelShape, ideal_speedup
from prefixdpo.data.example import Example
from prefixdpo.data.stats import compute_stats
from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
from prefixdpo.errors import UserError

SHAPE = ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256)


def ex(p, *rs, i=0):
    return Example(tuple(range(1, p + 1)), tuple(tuple([7] * r) for r in rs), source_index=i)


def test_known_numbers():
    examples = [ex(10, 5, 5), ex(10, 5, 5), ex(30, 10, 10, 10)]
    s = compute_stats(examples, pack_length=64, speedup=ideal_speedup(SHAPE, examples), model_name="tiny")
    assert (s.examples, s.responses) == (3, 7)
    assert (s.prompt.median, s.prompt.max) == (10, 30)
    assert (s.row.median, s.row.max) == (20, 60)
    assert s.prompt_response_ratio == 2.0
    assert (s.shared_tokens, s.unshared_tokens) == (100, 180)
    assert s.token_saving == pytest.approx(1 - 100 / 180)
    # Rows 60, 20, 20 into packs of 64: best fit gives [60], [20, 20].
    assert (s.packs, s.rows_over_pack_length) == (2, 0)
    assert s.packing_efficiency == pytest.approx(100 / 128)
    assert s.speedup == pytest.approx(ideal_speedup(SHAPE, examples)) and s.speedup > 1
    text = s.format()
    assert "tokens saved        44.4% vs standard DPO" in text and "1." in text and "for tiny" in text


def test_auto_pack_length_and_rows_over_explicit_length():
    examples = [ex(100, 20, 20), ex(10, 5, 5)]
    assert compute_stats(examples).pack_length == 256  # 1.1 x p95 (138.4) -> 152.2, rounded up to 128s
    s = compute_stats(examples, pack_length=128)
    assert s.rows_over_pack_length == 1 and s.packing_efficiency == pytest.approx(20 / 128)
    assert "1 rows exceed the pack length" in s.format()
    assert compute_stats(examples).speedup is None


def test_no_examples():
    with pytest.raises(UserError, match="no examples to compute statistics on"):
        compute_stats([])


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer().save_pretrained(str(path))
    return str(path)


def test_inspect_cli(tmp_path, tok_dir, capsys):
    from prefixdpo.cli import main

    data = tmp_path / "d.jsonl"
    recs = [{"prompt": "Question: what is the capital of France? " * (1 + i % 4), "chosen": " Paris.", "rejected": " Rome."}
            for i in range(20)] + [{"prompt": "p", "chosen": "same", "rejected": "same"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["inspect", str(data), "--tokenizer", tok_dir, "--pack-length", "256", "--max-samples", "21",
                 "--invalid", "skip"]) == 0
    out = capsys.readouterr().out
    assert "Loaded 21 records, kept 20 examples (20 standard). Skipped 1 invalid (identical_responses: 1" in out
    assert "packing" in out and "at pack length 256" in out and "predicted speedup" in out and "Llama-3.1-8B" in out
    for invalid in ([], ["--invalid", "error"]):  # error is train's default, so inspect's too
        assert main(["inspect", str(data), "--tokenizer", tok_dir, *invalid]) == 2
        err = capsys.readouterr().err
        assert err.strip() == "prefixdpo inspect: error: record 20: chosen and rejected are identical"
    assert main(["inspect", str(data), "--tokenizer", tok_dir, "--pack-length", "big"]) == 2
    assert capsys.readouterr().err.strip() == (
        "prefixdpo inspect: error: pack_length='big': expected 'auto' or a positive integer")
    with pytest.raises(SystemExit):
        main(["inspect", str(data), "--tokenizer", tok_dir, "--truncation-mode", "middle"])


def test_inspect_prepares_lengths_as_train(tmp_path, tok_dir, capsys):
    """An over-long prompt: with train's defaults (max_length 1024, keep_start) the example is dropped and
    counted; with keep_end its prompt is cut so every sequence has max_length tokens, and counted."""
    from prefixdpo.cli import main
    from prefixdpo.dpo.config import DataArguments, data_options
    from prefixdpo import PrefixDPOConfig
    from prefixdpo.data.prepare import prepare_examples

    tok = build_tiny_tokenizer()
    data = tmp_path / "d.jsonl"
    long_prompt = "Question: what is the capital of France? " * 120
    recs = [{"prompt": "Question: capital of France?", "chosen": " Paris.", "rejected": " Rome."},
            {"prompt": long_prompt, "chosen": " Paris.", "rejected": " Rome."}]
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = len(tok(long_prompt)["input_ids"])
    assert p > 1024
    assert main(["inspect", str(data), "--tokenizer", tok_dir]) == 0
    out = capsys.readouterr().out
    assert (f"Loaded 2 records, kept 1 examples (1 standard). Dropped 1 over max_length "
            f"(e.g. record 1: prompt of {p} tokens leaves no room within max_length 1024).") in out
    assert main(["inspect", str(data), "--tokenizer", tok_dir, "--truncation-mode", "keep_end"]) == 0
    out = capsys.readouterr().out
    # train's own preparation of the same file and options
    config = PrefixDPOConfig(truncation_mode="keep_end")
    train = prepare_examples(str(data), tok, data_options(config, DataArguments(dataset_name=str(data))))
    ex = train.examples[1]
    assert max(len(ex.prompt_ids) + len(r) for r in ex.response_ids) == 1024
    assert "Loaded 2 records, kept 2 examples (2 standard). Truncated 1." in out and train.report.truncated == 1
    assert f"shared row tokens   median {(train.examples[0].shared_length + ex.shared_length) / 2:g}" in out
    assert f"max {ex.shared_length}\n" in out and ex.shared_length > 1024  # the row holds two sequences


def test_inspect_show_mask_draws_a_packed_line(tmp_path, tok_dir, capsys):
    from PIL import Image

    from prefixdpo.cli import main

    data = tmp_path / "d.jsonl"
    recs = [{"prompt": "Tell me about the sea. " * (1 + i % 3), "chosen": " It is wide.", "rejected": " It is dry."}
            for i in range(10)]
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    png = tmp_path / "mask.png"
    assert main(["inspect", str(data), "--tokenizer", tok_dir, "--pack-length", "256", "--show-mask", str(png)]) == 0
    assert "attention mask of one packed line written to" in capsys.readouterr().out
    colours = {c for _, c in Image.open(png).convert("RGB").getcolors(1 << 20)}
    assert len(colours) > 5  # prompt, responses, padding and not-allowed areas are told apart
