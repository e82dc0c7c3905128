"""`prefixdpo verify` on a saved tiny model: exits 0 when exact, non-zero on a broken layout, has --help."""

import pytest

from prefixdpo.cli import main
from conftest import tiny_model


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from prefixdpo.commands.verify import DEFAULT_PROMPTS, DEFAULT_RESPONSES

    path = tmp_path_factory.mktemp("tiny")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DEFAULT_PROMPTS + DEFAULT_RESPONSES, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(path)
    tiny_model("qwen2", vocab_size=len(tokenizer)).save_pretrained(path)
    return str(path)


def test_verify_passes_on_exact_setup(saved_model, capsys):
    assert main(["verify", "--model", saved_model]) == 0
    out = capsys.readouterr().out
    assert "prefix sharing matches separate passes" in out
    for case in ("unpacked (one row per example)", "packed (all examples in one row)",
                 "packed (two rows, with padding)", "standard sequences packed, no sharing"):
        line = next(x for x in out.splitlines() if x.startswith(case))
        assert line.split()[-1] == "ok", line


def test_verify_fails_on_broken_layout(saved_model, capsys):
    assert main(["verify", "--model", saved_model, "--no-restart-positions"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--help"])
    assert exit_info.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_verify_missing_model_is_one_line_error(tmp_path, capsys):
    assert main(["verify", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]
