"""Bad user input through the real command line: one stderr line naming the problem, exit code 2, no traceback.

`prefixdpo.cli.main` prints a `UserError` as `prefixdpo COMMAND: error: MESSAGE` and exits 2; any other
exception is a bug and propagates (so here it would fail the test with its traceback). Each case runs
`prefixdpo train` in-process on the embedded default model (built locally, no downloads) with a dataset
or an option that is wrong in one way.
"""

from __future__ import annotations

import json
import re

import pytest

from prefixdpo.cli import main

GOOD = [{"prompt": f"Question {i}: repeat the words red blue.", "chosen": " red blue", "rejected": " blue red"}
        for i in range(4)]


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(autouse=True)
def _no_progress_bars():
    """Building the default model draws transformers' progress bars on stderr; off here, so stderr holds
    exactly what the command itself writes."""
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    yield
    if was_on:
        logging.enable_progress_bar()


def _stderr_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()


def test_record_missing_rejected_is_one_line_naming_the_record(tmp_path, capsys):
    bad = {"prompt": "Question 9: repeat the words red blue.", "chosen": " red blue"}  # no 'rejected'
    data = _write_jsonl(tmp_path / "d.jsonl", [GOOD[0], bad, GOOD[1]])
    code = main(["train", "--dataset", data, "--output-dir", str(tmp_path / "o"), "--max-steps", "1"])
    assert code == 2
    assert _stderr_lines(capsys) == ["prefixdpo train: error: record 1: missing field 'rejected'"]


@pytest.mark.parametrize(
    "options, message",
    [
        # the pack length is shorter than a prefix-shared row: RowTooLongError, raised while planning packs
        (["--packing", "true", "--pack-length", "8", "--max-length", "none"],
         r"record 0: its row holds \d+ tokens, more than pack_length=8 \(raise pack_length, or lower max_length"),
        (["--resume-from-checkpoint", "latest"], r"resume_from_checkpoint='latest': no checkpoint-\* folder in "),
    ],
    ids=["pack_length_too_small", "resume_latest_without_checkpoint"],
)
def test_bad_option_during_training_is_one_line(tmp_path, capsys, options, message):
    data = _write_jsonl(tmp_path / "d.jsonl", GOOD)
    code = main(["train", "--dataset", data, "--output-dir", str(tmp_path / "o"), "--max-steps", "1", *options])
    assert code == 2
    (line,) = _stderr_lines(capsys)
    assert re.match(r"prefixdpo train: error: " + message, line), line
