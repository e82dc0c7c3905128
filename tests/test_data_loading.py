"""Loading records from local files, save_to_disk directories and in-memory datasets (never the Hub)."""

from __future__ import annotations

import json

import pytest

datasets = pytest.importorskip("datasets")

from prefixdpo.data.loading import load_records  # noqa: E402
from prefixdpo.data.prepare import DataOptions, prepare_examples  # noqa: E402
from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from prefixdpo.data.validation import InvalidRecordError  # noqa: E402
from prefixdpo.errors import UserError  # noqa: E402

RECORDS = [{"prompt": f"Question {i}:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(6)]
CHAT = [{"prompt": [{"role": "user", "content": f"hi {i}"}], "chosen": [{"role": "assistant", "content": "hello"}],
         "rejected": [{"role": "assistant", "content": "go"}]} for i in range(3)]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(autouse=True)
def _quiet(tmp_path, monkeypatch):
    datasets.disable_progress_bars()
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def as_dicts(records):
    return [dict(records[i]) for i in range(len(records))]


def test_jsonl_and_json_array(tmp_path):
    assert as_dicts(load_records(write_jsonl(tmp_path / "d.jsonl", RECORDS))) == RECORDS
    (tmp_path / "d.json").write_text(json.dumps(CHAT))
    assert as_dicts(load_records(str(tmp_path / "d.json"))) == CHAT


def test_jsonl_bad_lines_keep_numbering(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(RECORDS[0]).encode(), b"{not json", b"", json.dumps(RECORDS[1]).encode()[:-1] + b"\xff}",
             json.dumps(RECORDS[2]).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    recs = load_records(path)
    assert len(recs) == 4  # the blank line is not a record
    assert isinstance(recs[1], InvalidRecordError) and str(recs[1]) == "record 1: line 2 is not valid JSON " \
        "(Expecting property name enclosed in double quotes)"
    assert str(recs[2]).startswith("record 2: line 4 is not valid UTF-8 (byte ")
    rep = prepare_examples(path, tok, DataOptions(invalid="skip")).report
    assert (rep.loaded, rep.kept, dict(rep.skipped)) == (4, 2, {"bad_json": 1, "not_utf8": 1})
    with pytest.raises(InvalidRecordError, match="^record 1: line 2 is not valid JSON"):
        prepare_examples(path, tok)


def test_parquet_csv_and_save_to_disk(tmp_path):
    ds = datasets.Dataset.from_list(RECORDS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    for source in ("d.parquet", "d.csv", "saved"):
        assert as_dicts(load_records(tmp_path / source)) == RECORDS, source


def test_conversational_parquet_round_trips(tmp_path, tok):
    datasets.Dataset.from_list(CHAT).to_parquet(str(tmp_path / "c.parquet"))
    from_file = prepare_examples(str(tmp_path / "c.parquet"), tok).examples
    from_list = prepare_examples(CHAT, tok).examples
    assert from_file == from_list and len(from_file) == 3


def test_splits_dataset_dict_and_eval_split(tmp_path, tok):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS), "test": datasets.Dataset.from_list(RECORDS[:2])})
    assert len(load_records(dd)) == 6 and len(load_records(dd, split="test")) == 2
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(load_records(tmp_path / "dd", split="test")) == 2
    with pytest.raises(UserError, match=r"no split 'dev' \(available: train, test\)"):
        load_records(dd, split="dev")
    data = prepare_examples(str(tmp_path / "dd"), tok, DataOptions(eval_split="test"))
    assert (len(data.examples), len(data.eval_examples), data.eval_report.loaded) == (6, 2, 2)
    split_files = {"train": str(write_jsonl(tmp_path / "tr.jsonl", RECORDS)), "test": RECORDS[:1]}
    assert len(load_records(split_files, split="test")) == 1


def test_in_memory_dataset_and_max_samples(tok):
    ds = datasets.Dataset.from_list(RECORDS)
    assert len(load_records(ds, max_samples=4)) == 4 and len(load_records(RECORDS, max_samples=10)) == 6
    data = prepare_examples(ds, tok, DataOptions(max_samples=3))
    assert data.report.loaded == 3 and [e.source_index for e in data.examples] == [0, 1, 2]


def test_path_errors(tmp_path):
    with pytest.raises(UserError, match="no such file or directory: ./missing.jsonl") as info:
        load_records("./missing.jsonl")
    assert isinstance(info.value, FileNotFoundError)  # callers catching the OS error still do
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    with pytest.raises(UserError, match="a single file has only the split 'train', not 'test'"):
        load_records(path, split="test")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(UserError, match="unknown file type '.txt'"):
        load_records(tmp_path / "d.txt")
