"""Records -> Example token ids equal a standard full tokenization, for every format, whatever the boundary does."""

from __future__ import annotations

import pytest

from prefixdpo.data.prepare import DataOptions, prepare_examples
from prefixdpo.data.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer
from prefixdpo.data.tokenize import split_at_boundary

CORPUS = [
    "hello world hello there help me helpful hello help " * 4,
    "Question: what is the capital of France? Answer: Paris. Question: and Italy? Answer: Rome. " * 3,
]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(CORPUS)


@pytest.fixture(scope="module")
def merging_tok():
    # No pre-tokenization regex: BPE merges cross spaces and words, so "say hel" + "lo" merges across the cut.
    return build_tiny_tokenizer(CORPUS, use_regex=False)


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def full_text_ids(tokenizer, prompt, response):
    return tokenizer(prompt + response + tokenizer.eos_token)["input_ids"]


def full_chat_ids(tokenizer, conversation):
    return tokenizer.apply_chat_template(conversation, tokenize=True)["input_ids"]


def prepare(records, tokenizer, **kw):
    return prepare_examples(records, tokenizer, DataOptions(**kw))


def assert_round_trip(example, expected_full):
    for k, full in enumerate(expected_full):
        assert list(example.prompt_ids) + list(example.response_ids[k]) == full, f"response {k}"


@pytest.mark.parametrize("fixture", ["tok", "merging_tok"])
def test_standard_round_trip(fixture, request):
    tokenizer = request.getfixturevalue(fixture)
    records = [
        {"prompt": "Question: what is the capital of France? Answer:", "chosen": " Paris.", "rejected": " Rome."},
        {"prompt": "Question: and Italy? Answer: ", "chosen": "Rome.", "rejected": "Paris."},  # space ends the prompt
        {"prompt": "say hel", "chosen": "lo world", "rejected": "p me"},  # cut inside a word
    ]
    data = prepare(records, tokenizer)
    assert data.report.kept == 3
    for rec, ex in zip(records, data.examples):
        assert_round_trip(ex, [full_text_ids(tokenizer, rec["prompt"], rec[r]) for r in ("chosen", "rejected")])
        assert ex.prompt_ids[0] == tokenizer.bos_token_id
        assert all(r[-1] == tokenizer.eos_token_id for r in ex.response_ids)
        # The shared prompt is a prefix of the prompt tokenized alone: only its tail can move.
        alone = tokenizer(rec["prompt"])["input_ids"]
        assert list(ex.prompt_ids) == alone[: len(ex.prompt_ids)]
        assert ex.meta.get("boundary_adjusted", 0) == len(alone) - len(ex.prompt_ids)


def test_cross_boundary_merge_is_split_at_last_safe_token(merging_tok):
    t = merging_tok
    prompt, chosen, rejected = "say hel", "lo world", "p me"
    alone = t(prompt)["input_ids"]
    full_c = full_text_ids(t, prompt, chosen)
    full_r = full_text_ids(t, prompt, rejected)
    # Precondition: the tokenizer really merges across the boundary, and differently for the two responses.
    assert full_c[: len(alone)] != alone and full_r[: len(alone)] != alone
    (ex,) = prepare([{"prompt": prompt, "chosen": chosen, "rejected": rejected}], t).examples
    assert_round_trip(ex, [full_c, full_r])
    assert 0 < ex.meta["boundary_adjusted"] < len(alone)
    # The decoded pieces still add up to the text: no character dropped or duplicated.
    for full_ids, resp in ((full_c, ex.response_ids[0]), (full_r, ex.response_ids[1])):
        assert t.decode(list(ex.prompt_ids) + list(resp)) == t.decode(full_ids)


def test_no_adjustment_when_boundary_is_clean(tok):
    (ex,) = prepare([{"prompt": "Question: and Italy? Answer:", "chosen": " Rome.", "rejected": " Paris."}], tok).examples
    assert list(ex.prompt_ids) == tok("Question: and Italy? Answer:")["input_ids"]
    assert "boundary_adjusted" not in ex.meta


def test_eos_added_once_and_optional(tok):
    eos = tok.eos_token
    rec = {"prompt": "Q:", "chosen": " yes" + eos, "rejected": " no"}
    (ex,) = prepare([rec], tok).examples
    assert [r.count(tok.eos_token_id) for r in ex.response_ids] == [1, 1]
    (ex,) = prepare([rec], tok, add_eos=False).examples
    assert ex.response_ids[0][-1] == tok.eos_token_id and ex.response_ids[1][-1] != tok.eos_token_id


def test_conversational_round_trip_with_template_tokens(tok):
    prompt = msgs(("user", "what is the capital of France?"))
    chosen, rejected = msgs(("assistant", "Paris.")), msgs(("assistant", "Rome, I think."))
    (ex,) = prepare([{"prompt": prompt, "chosen": chosen, "rejected": rejected}], tok).examples
    assert_round_trip(ex, [full_chat_ids(tok, prompt + chosen), full_chat_ids(tok, prompt + rejected)])
    assert tok.decode(ex.prompt_ids).endswith("<|im_start|>assistant\n")
    assert tok.decode(ex.response_ids[0]) == "Paris.<|im_end|>\n"  # the template's turn end, no extra EOS
    assert ex.prompt_ids.count(tok.bos_token_id) == 1  # BOS from the template only, not doubled


def test_multi_turn_and_implicit_prompt(tok):
    head = msgs(("user", "hello"), ("assistant", "hello there"), ("user", "help me"))
    chosen = head + msgs(("assistant", "helpful answer"))
    rejected = head + msgs(("assistant", "no"))
    data = prepare([{"chosen": chosen, "rejected": rejected}, {"prompt": head, "chosen": chosen[3:], "rejected": rejected[3:]}], tok)
    implicit, explicit = data.examples
    assert implicit.meta["format"] == "implicit" and explicit.meta["format"] == "conversational"
    assert_round_trip(implicit, [full_chat_ids(tok, chosen), full_chat_ids(tok, rejected)])
    assert implicit.prompt_ids == explicit.prompt_ids and implicit.response_ids == explicit.response_ids


def test_template_rendering_prompt_differently_is_cut_where_sequences_diverge():
    # A template whose generation prompt ends with an empty thought block that full conversations lack
    # (as Gemma / DeepSeek templates do): the prompt alone is not a prefix of the full sequence.
    template = CHAT_TEMPLATE.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think></think>'")
    assert template != CHAT_TEMPLATE
    t = build_tiny_tokenizer(CORPUS)
    t.chat_template = template
    prompt = msgs(("user", "hello"))
    chosen, rejected = msgs(("assistant", "hello there")), msgs(("assistant", "help"))
    (ex,) = prepare([{"prompt": prompt, "chosen": chosen, "rejected": rejected}], t).examples
    assert_round_trip(ex, [full_chat_ids(t, prompt + chosen), full_chat_ids(t, prompt + rejected)])
    assert ex.meta["boundary_adjusted"] > 0
    assert "<think>" not in t.decode(ex.prompt_ids)


def test_multi_response_round_trip(merging_tok):
    t = merging_tok
    rec = {"prompt": "say hel", "completions": ["lo world", "p me", "lo there", "lp"], "scores": [3, 1, 2, 0]}
    (ex,) = prepare([rec], t, pairs_policy="all_pairs").examples
    assert ex.num_responses == 4
    assert_round_trip(ex, [full_text_ids(t, rec["prompt"], c) for c in rec["completions"]])
    assert set(ex.pairs) == {(0, 1), (0, 2), (0, 3), (2, 1), (2, 3), (1, 3)}


def test_multi_response_conversational(tok):
    prompt = msgs(("user", "hello"))
    comps = [msgs(("assistant", a)) for a in ("hello there", "help", "no")]
    (ex,) = prepare([{"prompt": prompt, "completions": comps, "ranks": [2, 1, 3]}], tok, pairs_policy="best_vs_each").examples
    assert_round_trip(ex, [full_chat_ids(tok, prompt + c) for c in comps])
    assert ex.pairs == ((1, 0), (1, 2))


def test_split_at_boundary_unit():
    ex = split_at_boundary(0, [5, 6, 7], [[5, 6, 9, 1], [5, 6, 7, 2]])
    assert ex.prompt_ids == [5, 6] and ex.response_ids == [[9, 1], [7, 2]] and ex.boundary_adjusted == 1


def test_same_ids_as_trl_preprocessing(tok, merging_tok):
    """Our Example ids equal what TRL 1.16's DPOTrainer._prepare_dataset produces for the same record."""
    import types

    datasets = pytest.importorskip("datasets")
    dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_end")
    head = msgs(("user", "hello"), ("assistant", "hello there"), ("user", "help me"))
    cases = [
        (merging_tok, [{"prompt": "say hel", "chosen": "lo world", "rejected": "p me"},
                       {"prompt": "Question: and Italy? Answer: ", "chosen": "Rome.", "rejected": "Paris."}]),
        (tok, [{"prompt": msgs(("user", "hello")), "chosen": msgs(("assistant", "hi")),
                "rejected": msgs(("assistant", "help"))}]),
        (tok, [{"chosen": head + msgs(("assistant", "helpful")), "rejected": head + msgs(("assistant", "no"))}]),
    ]
    for t, records in cases:
        stub = types.SimpleNamespace(_tokenizer=t)
        trl_rows = dpo.DPOTrainer._prepare_dataset(stub, datasets.Dataset.from_list(records), t, args, "train")
        ours = prepare(records, t).examples
        for row, ex in zip(trl_rows, ours):
            assert list(ex.prompt_ids) == row["prompt_ids"]
            assert [list(r) for r in ex.response_ids] == [row["chosen_ids"], row["rejected_ids"]]
