"""The embedded default (`prefixdpo_tools.demo`) and the `prefixdpo train` command on it."""

from __future__ import annotations

import hashlib
import json

import torch

from prefixdpo.cli import main
from prefixdpo_tools.demo import DemoSpec, build_demo, make_splits


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_records_are_deterministic_standard_format_and_not_constant():
    train, held_out = make_splits()
    again, _ = make_splits()
    assert train == again
    assert len(train) == DemoSpec().num_train and len(held_out) == DemoSpec().num_eval
    for r in train + held_out:
        assert set(r) == {"prompt", "chosen", "rejected"}
        assert all(isinstance(v, str) and v for v in r.values())
        assert r["chosen"] != r["rejected"]
        assert len(r["prompt"]) > 4 * len(r["chosen"])  # long prompts: prefix sharing pays
    # No constant preference wins: "the upper-case / the ascending one" is chosen about half the time.
    case = [r for r in train if "repeat the words" in r["prompt"]]
    order = [r for r in train if "write the numbers" in r["prompt"]]
    assert len(case) + len(order) == len(train) and min(len(case), len(order)) > 0.4 * len(train)
    upper = sum(r["chosen"].isupper() for r in case) / len(case)
    ascending = sum(r["chosen"].split() == sorted(r["chosen"].split()) for r in order) / len(order)
    assert 0.45 < upper < 0.55 and 0.45 < ascending < 0.55
    # held out: no eval prompt occurs in the training split
    assert not {r["prompt"] for r in held_out} & {r["prompt"] for r in train}


def test_chosen_follows_the_stated_rule():
    train, _ = make_splits(DemoSpec(num_train=200, num_eval=1))
    for r in train:
        words = r["prompt"].split("Task: ")[1]
        if "repeat the words" in words:
            wants_upper = any(p in words for p in ("UPPERCASE", "capital letters", "upper case", "ALL CAPS"))
            assert r["chosen"].isupper() == wants_upper and r["rejected"].isupper() != wants_upper
            assert r["chosen"].lower() == r["rejected"].lower()
        else:
            digits = [int(d) for d in r["chosen"].split()]
            wants_up = any(p in words for p in ("increasing", "ascending", "smallest-first"))
            assert digits == sorted(digits, reverse=not wants_up)
            assert r["rejected"].split() == r["chosen"].split()[::-1]


def test_build_demo_is_deterministic_and_loadable(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build_demo(tmp_path / "a")
    b = build_demo(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(a.model_dir / name) == _sha(b.model_dir / name), name
    assert _sha(a.train_file) == _sha(b.train_file) and _sha(a.eval_file) == _sha(b.eval_file)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == len(tok)
    assert tok.bos_token and tok.eos_token and tok.pad_token and tok.chat_template
    record = json.loads(a.train_file.read_text().splitlines()[0])
    text = record["prompt"] + record["chosen"]
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text  # byte-level: round-trips
    with torch.no_grad():
        logits = model(torch.tensor([tok(text).input_ids])).logits
    assert torch.isfinite(logits).all()


def test_train_help_and_bad_option(capsys):
    assert main(["train", "--help"]) == 0
    assert "--model" in capsys.readouterr().out
    assert main(["train", "--no-such-option", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--no-such-option" in err and len(err.splitlines()) == 1


def test_full_default_run_via_cli_learns_the_preference(tmp_path, capsys):
    """The whole embedded default (what `make demo` runs; ~25 s on 2 cores): finishes, saves a loadable
    model, and reaches well-above-chance held-out reward accuracy (aim >= 0.8; measured 0.995)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    code = main(["train", "--output-dir", str(out), "--disable-tqdm", "true"])
    assert code == 0
    stdout = capsys.readouterr().out
    line = next(x for x in stdout.splitlines() if x.startswith("Held-out reward accuracy"))
    accuracy = float(line.split(":")[1].split()[0])
    assert accuracy >= 0.8, line
    assert f"Model saved to {out}" in stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == DemoSpec().num_layers
    base = AutoModelForCausalLM.from_pretrained(out / "demo-base" / "model")
    moved = any(not torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters()))
    assert moved, "training changed no weight"


def test_train_on_a_given_model_and_dataset_by_path(tmp_path, capsys):
    """Any HF model directory and record file work by path (here: the default's saved artifacts)."""
    base = build_demo(tmp_path / "base")
    out = tmp_path / "out"
    code = main(["train", "--model", str(base.model_dir), "--dataset", str(base.train_file), "--max-samples", "32",
                 "--max-steps", "2", "--per-device-train-batch-size", "8", "--learning-rate", "1e-3",
                 "--output-dir", str(out), "--disable-tqdm", "true"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "Loaded 32 records, kept 32 examples" in stdout and "No held-out split" in stdout
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert not (out / "demo-base").exists()  # nothing of the default was built


def test_missing_dataset_file_is_one_line_error(tmp_path, capsys):
    assert main(["train", "--dataset", str(tmp_path / "nope.jsonl"), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # (progress bars of the default model's build come first)
    assert "nope.jsonl" in err[-1] and sum("error" in line for line in err) == 1
