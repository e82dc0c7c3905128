"""Input that must not be lost or swallow the machine (issue 35, findings 5 and 6), through the command line.

- A record over `--max_record_bytes` (default 16 MiB) is refused in one line naming its file, line and size, or
  skipped and counted with `--invalid skip`, before it is parsed; reading a file with a 96 MiB line takes memory
  bounded by the limit, not the line (peak RSS of the real command, in a subprocess).
- A dataset folder reads every data file it holds, or is refused in one line naming the files it would leave out
  (`train.jsonl` + `more.csv` + `README.txt` read only `train.jsonl` before); README/LICENSE/hidden files may stay.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefixdpo.cli import main

RECORD = {"prompt": "What is the capital of France?", "chosen": " Paris.", "rejected": " Rome."}
DEFAULT_LIMIT = 16 * 2**20
ADVICE = "(raise it, or 0 for no limit; --invalid skip leaves the record out, counted)"


def huge_line(prompt_bytes: int) -> bytes:
    """One record whose prompt holds `prompt_bytes` bytes, written in one piece (no per-byte work)."""
    return b'{"prompt": "' + b"x" * prompt_bytes + b'", "chosen": " yes", "rejected": " no"}'


def write_records(path: Path, n: int = 8, huge: bytes | None = None, at: int = 3) -> Path:
    """`n` small records as JSON Lines, with the line `huge` before record `at` when given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for i in range(n):
            if huge is not None and i == at:
                fh.write(huge + b"\n")
            fh.write(json.dumps({**RECORD, "prompt": f"{RECORD['prompt']} {i}"}).encode() + b"\n")
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny local model folder with its tokenizer (no downloads)."""
    from transformers.utils import logging as hf_logging

    from grpo_common import saved_tiny_model, tokenizer

    import datasets

    hf_logging.disable_progress_bar()  # stderr must hold exactly what the command writes
    datasets.disable_progress_bars()
    folder = saved_tiny_model(tmp_path_factory.mktemp("model") / "m")
    tokenizer().save_pretrained(folder)
    return folder


def refused(capsys, argv: list[str], out: Path | None = None) -> str:
    """Run the command ARGV: assert exit 2, one stderr line, no traceback, nothing written to `out`; return the
    message after `prefixdpo COMMAND: error: `."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    prefix = f"prefixdpo {argv[0]}: error: "
    assert lines[0].startswith(prefix), lines[0]
    assert out is None or not out.exists() or not any(out.iterdir()), "a refused run wrote to output_dir"
    return lines[0].removeprefix(prefix)


def inspected(capsys, argv: list[str]) -> str:
    """`prefixdpo inspect ARGV`: assert exit 0; its stdout."""
    capsys.readouterr()
    assert main(["inspect", *argv]) == 0
    return capsys.readouterr().out


# ---- finding 5: a record over --max_record_bytes ---------------------------------------------------------------


def test_a_record_over_the_default_limit_is_refused_naming_file_line_and_size(tmp_path, model, capsys):
    big = huge_line(DEFAULT_LIMIT)  # 16 MiB of prompt + the rest of the record: over the default
    data = write_records(tmp_path / "prefs.jsonl", huge=big, at=3)
    out = tmp_path / "out"
    msg = refused(capsys, ["train", "--model", model, "--dataset", str(data), "--output_dir", str(out),
                           "--max_steps", "1"], out)
    assert msg == (f"record 3: {data} line 4 holds {len(big)} bytes, more than --max_record_bytes {DEFAULT_LIMIT} "
                   f"{ADVICE}")


def test_invalid_skip_leaves_a_record_over_the_limit_out_and_counts_it(tmp_path, model, capsys):
    big = huge_line(300)
    data = write_records(tmp_path / "prefs.jsonl", huge=big, at=3)
    out = inspected(capsys, [str(data), "--tokenizer", model, "--max-record-bytes", "200", "--invalid", "skip"])
    assert (f"Loaded 9 records, kept 8 examples (8 standard). Skipped 1 invalid (too_big: 1; e.g. record 3: {data} "
            f"line 4 holds {len(big)} bytes, more than --max_record_bytes 200 {ADVICE})") in out
    # 0: no limit, the record is read as any other
    assert "Loaded 9 records, kept 9 examples" in inspected(capsys, [str(data), "--tokenizer", model,
                                                                     "--max-record-bytes", "0"])
    assert refused(capsys, ["inspect", str(data), "--tokenizer", model, "--max-record-bytes", "-1"]) == (
        "max_record_bytes=-1: expected a number of bytes >= 0 (0: no limit)")


def test_a_json_list_record_over_the_limit_is_refused_by_its_text(tmp_path, model, capsys):
    """A JSON list is read whole (no line to cut it at): its records are measured by their text, keys and values,
    as CSV rows are."""
    records = [RECORD, {**RECORD, "prompt": "y" * 300}, RECORD]
    data = tmp_path / "prefs.json"
    data.write_text(json.dumps(records, indent=1))
    size = sum(len(k) + len(v) for k, v in records[1].items())
    msg = refused(capsys, ["inspect", str(data), "--tokenizer", model, "--max-record-bytes", "200"])
    assert msg == f"record 1: holds {size} bytes of text, more than --max_record_bytes 200 {ADVICE}"


def test_a_csv_row_over_the_limit_is_refused_by_its_text_before_tokenizing(tmp_path, model, capsys):
    """CSV, Parquet and Arrow rows are read by datasets: measured by their text (keys and values) before the
    tokenizer sees them."""
    data = tmp_path / "prefs.csv"
    data.write_text("prompt,chosen,rejected\nhi,yes,no\n" + "w" * 300 + ",yes,no\nhello,yes,no\n")
    size = len("prompt" + "w" * 300 + "chosen" + "yes" + "rejected" + "no")
    msg = refused(capsys, ["inspect", str(data), "--tokenizer", model, "--max-record-bytes", "200"])
    assert msg == f"record 1: holds {size} bytes of text, more than --max_record_bytes 200 {ADVICE}"
    out = inspected(capsys, [str(data), "--tokenizer", model, "--max-record-bytes", "200", "--invalid", "skip"])
    assert "Loaded 3 records, kept 2 examples (2 standard). Skipped 1 invalid (too_big: 1; e.g. record 1" in out


@pytest.mark.parametrize("command", ["grpo", "rloo"])
def test_grpo_and_rloo_refuse_a_prompt_record_over_the_limit(command, tmp_path, model, capsys):
    data = tmp_path / "prompts.jsonl"
    big = b'{"prompt": "' + b"z" * 500 + b'"}'
    data.write_bytes(b'{"prompt": "hello"}\n' + big + b'\n{"prompt": "there"}\n')
    out = tmp_path / "out"
    msg = refused(capsys, [command, "--model", model, "--dataset", str(data), "--max_record_bytes", "100",
                           "--reward_funcs", "prefixdpo_tools.demo_grpo:vowel_share", "--output_dir", str(out),
                           "--max_steps", "1"], out)
    assert msg == f"record 1: {data} line 2 holds {len(big)} bytes, more than --max_record_bytes 100 {ADVICE}"
    from prefixdpo.grpo.data import load_prompts

    prompts, report = load_prompts(str(data), invalid="skip", max_record_bytes=100)
    assert (len(prompts), report.loaded, dict(report.skipped.counts)) == (2, 3, {"too_big": 1})


# In a fresh process: `prefixdpo inspect --invalid skip` on the plain file, then on the file with the huge line;
# the peak resident memory (ru_maxrss, KiB) after each. A peak only grows, so the second less the first is what the
# huge line added beyond the plain run's own peak: reading it costs about twice the limit (readline's piece of
# limit + 2 bytes and its join: 32 MiB measured), while a line held whole is a fresh allocation of its 96 MiB.
_TWO_PEAKS = """
import resource, sys
from prefixdpo.cli import main
model, *files = sys.argv[1:]
for path in files:
    code = main(["inspect", path, "--tokenizer", model, "--invalid", "skip"])
    print("PEAK", code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def test_reading_a_96_mib_line_takes_memory_bounded_by_the_limit_not_the_line(tmp_path, model):
    """Peak resident memory of `prefixdpo inspect --invalid skip` on 8 records, then on the same with a 96 MiB line
    among them (before: the line was read, decoded and tokenized whole; a 200 MB one passed 6 GB, and a 64 MiB one
    with --max_record_bytes 0 passes 3.9 GB)."""
    plain = write_records(tmp_path / "plain.jsonl")
    with_huge = write_records(tmp_path / "huge.jsonl", huge=huge_line(96 * 2**20), at=3)
    run = subprocess.run([sys.executable, "-c", _TWO_PEAKS, model, str(plain), str(with_huge)],
                         capture_output=True, text=True, timeout=300)
    peaks = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("PEAK ")]
    assert [code for code, _ in peaks] == ["0", "0"], run.stdout + run.stderr
    (_, base_kib), (_, huge_kib) = [(c, int(k)) for c, k in peaks]
    assert "Loaded 8 records, kept 8 examples" in run.stdout
    assert "Loaded 9 records, kept 8 examples (8 standard). Skipped 1 invalid (too_big: 1" in run.stdout
    assert huge_kib < base_kib + 64 * 1024, f"peak RSS {huge_kib} KiB with the 96 MiB line, {base_kib} KiB without"


# ---- finding 6: a dataset folder reads every data file or says which it would leave out ------------------------


def test_the_issues_folder_of_jsonl_csv_and_readme_is_refused_naming_the_csv(tmp_path, model, capsys):
    folder = tmp_path / "data"
    write_records(folder / "train.jsonl")
    (folder / "more.csv").write_text("prompt,chosen,rejected\n" + "".join(f"q{i},yes,no\n" for i in range(8)))
    (folder / "README.txt").write_text("Preference pairs.\n")
    out = tmp_path / "out"
    msg = refused(capsys, ["train", "--model", model, "--dataset", str(folder), "--output_dir", str(out),
                           "--max_steps", "1"], out)
    assert msg == (f"{folder}: holds data files of 2 types (csv: more.csv; json: train.jsonl); a dataset folder is "
                   "read with one reader, so keep one type in it or give one file as the dataset")


def test_a_file_whose_name_says_no_split_beside_one_that_does_is_refused_naming_it(tmp_path, model, capsys):
    folder = tmp_path / "data"
    write_records(folder / "train.jsonl")
    write_records(folder / "more.jsonl")
    msg = refused(capsys, ["inspect", str(folder), "--tokenizer", model])
    assert msg == (f"{folder}: more.jsonl would be read in no split: datasets splits a folder by file name (train*, "
                   "validation*, test*; here train: train.jsonl), and a file whose name says no split is left out "
                   "once another's does: rename it (e.g. train-NAME) or move it out of the folder")


def test_a_file_datasets_never_reads_by_its_name_is_refused_naming_it(tmp_path, model, capsys):
    folder = tmp_path / "data"
    write_records(folder / "a.jsonl")
    write_records(folder / "config.json", n=2)
    msg = refused(capsys, ["inspect", str(folder), "--tokenizer", model])
    assert msg == (f"{folder}: config.json would not be read: datasets never reads a file of that name in a dataset "
                   "folder, so rename it or move it out of the folder")


def test_a_folder_reads_every_data_file_and_leaves_readme_license_and_hidden_files(tmp_path, model, capsys):
    folder = tmp_path / "data"
    write_records(folder / "a.jsonl", n=3)
    write_records(folder / "b.jsonl", n=5)
    for name in ("README.md", "README.txt", "LICENSE", ".gitattributes", ".git/HEAD"):
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text("not data\n")
    assert "Loaded 8 records, kept 8 examples" in inspected(capsys, [str(folder), "--tokenizer", model])


def test_a_hub_style_folder_reads_its_splits_by_file_name(tmp_path, model, capsys):
    folder = tmp_path / "hub"
    write_records(folder / "data" / "train-00000-of-00002.jsonl", n=3)
    write_records(folder / "data" / "train-00001-of-00002.jsonl", n=4)
    write_records(folder / "data" / "test-00000-of-00001.jsonl", n=2)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n")
    out = inspected(capsys, [str(folder), "--tokenizer", model, "--dataset-test-split", "test"])
    assert "Loaded 7 records, kept 7 examples" in out and "Held-out split 'test': Loaded 2 records" in out
