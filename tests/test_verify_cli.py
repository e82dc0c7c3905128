"""`prefixdpo verify` on a saved tiny model: exits 0 when exact, non-zero on a broken layout, has --help."""

import pytest

from prefixdpo.cli import main
from prefixdpo.commands.verify import TREE_CASE
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
                 "packed (two rows, with padding)", "standard sequences packed, no sharing", TREE_CASE):
        line = next(x for x in out.splitlines() if x.startswith(case))
        assert line.split()[-1] == "ok", line


def test_the_tree_case_shares_a_system_prompt_and_prompts_across_records(saved_model):
    """Its records: one per pair of the built-in examples (5), all behind one system prompt, so their trie line
    holds the system prompt once (and the third prompt, named by 3 records, once)."""
    from transformers import AutoTokenizer

    from prefixdpo.commands.verify import _examples, _tree_examples
    from prefixdpo.data.tree import tree_line

    tokenizer = AutoTokenizer.from_pretrained(saved_model)
    examples = _examples(tokenizer, None)
    records = _tree_examples(tokenizer, examples)
    assert len(records) == sum(len(ex.pairs) for ex in examples) == 5
    system = len(records[0].prompt_ids) - len(examples[0].prompt_ids)
    assert system > 5 and all(r.prompt_ids[:system] == records[0].prompt_ids[:system] for r in records)
    line = tree_line(records)
    third = len(examples[2].prompt_ids)  # the rest of the third prompt, after the system prompt
    assert line.depth >= 2  # 3 here: two of the third prompt's responses also start alike
    assert len(line) <= sum(r.shared_length for r in records) - 4 * system - 2 * third


def test_verify_fails_on_broken_layout(saved_model, capsys):
    assert main(["verify", "--model", saved_model, "--no-restart-positions"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out
    assert next(x for x in out.splitlines() if x.startswith(TREE_CASE)).split()[-1] == "FAIL"


def test_verify_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--help"])
    assert exit_info.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_verify_missing_model_is_one_line_error(tmp_path, capsys):
    assert main(["verify", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]
