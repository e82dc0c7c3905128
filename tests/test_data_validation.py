"""Every invalid-record case: one clear line naming the record, raised under invalid="error", counted under "skip"."""

from __future__ import annotations

import math

import pytest

from prefixdpo.data.prepare import DataOptions, prepare_examples
from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
from prefixdpo.data.validation import InvalidRecordError
from prefixdpo.errors import ConfigError, UserError


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def m(role, content):
    return {"role": role, "content": content}


GOOD = {"prompt": "Question: capital of France? Answer:", "chosen": " Paris.", "rejected": " Rome."}
U, A, B = m("user", "hello"), m("assistant", "hi"), m("assistant", "go away")

CASES = [  # (bad record, reason, expected message after "record 1: ")
    ({"prompt": "p", "chosen": "a"}, "missing_field", "missing field 'rejected'"),
    ({"prompt": "p", "chosen": "a", "rejected": None}, "wrong_type", "field 'rejected' is null (None)"),
    ({"prompt": "p", "chosen": None, "rejected": None}, "wrong_type", "fields 'chosen' and 'rejected' are null (None)"),
    ({"chosen": None, "rejected": None}, "wrong_type", "fields 'chosen' and 'rejected' are null (None)"),
    ({"prompt": None, "completions": ["a", "b"], "scores": [1, 2]}, "wrong_type", "field 'prompt' is null (None)"),
    ({"prompt": "p", "completions": ["a", "b"], "scores": None}, "wrong_type", "field 'scores' is null (None)"),
    ({"prompt": "p", "completions": ["a", "b"], "scores": None, "ranks": None}, "wrong_type",
     "fields 'scores' and 'ranks' are null (None)"),
    ({"prompt": None, "chosen": "Q: a", "rejected": "Q: b"}, "implicit_text",
     "chosen and rejected are strings and field 'prompt' is null (None): where the prompt ends is ambiguous; "
     "add a 'prompt'"),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, "wrong_type", "field 'chosen' must be a string, got int"),
    ({"prompt": 7, "chosen": "a", "rejected": "b"}, "wrong_type", "field 'prompt' must be a string, got int"),
    ({"prompt": [U], "chosen": [{"role": "assistant"}], "rejected": [B]}, "missing_field", "chosen[0] has no 'content'"),
    ({"prompt": [{"role": "user"}], "chosen": [A], "rejected": [B]}, "missing_field", "prompt[0] has no 'content'"),
    ({"prompt": [U, {"content": "hi"}], "chosen": [A], "rejected": [B]}, "missing_field", "prompt[1] has no 'role'"),
    ({"prompt": ["hello"], "chosen": [A], "rejected": [B]}, "wrong_type",
     "prompt[0] must be a message dict with 'role' and 'content', got str"),
    ({"prompt": [U], "chosen": [m("assistant", None)], "rejected": [B]}, "wrong_type",
     "field 'chosen[0].content' must be a string, got None"),
    ({"prompt": [U], "chosen": "a", "rejected": "b"}, "wrong_type",
     "prompt is a conversation but chosen, rejected are strings: use one form for all fields"),
    (["p", "a", "b"], "wrong_type", "record must be a mapping of fields, got list"),
    ({"text": "hello"}, "unknown_format", "no preference fields (found ['text']); expected "
     "prompt/chosen/rejected, chosen/rejected, or prompt/completions/scores|ranks"),
    ({"prompt": "p"}, "missing_field", "missing fields 'chosen' and 'rejected' (or 'completions' with 'scores'/'ranks')"),
    ({"prompt": "  ", "chosen": "a", "rejected": "b"}, "empty_prompt", "prompt is empty"),
    ({"prompt": [], "chosen": [A], "rejected": [B]}, "empty_prompt", "prompt is empty"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "empty_response", "chosen is empty"),
    ({"prompt": [U], "chosen": [A], "rejected": [m("assistant", "")]}, "empty_response", "rejected is empty"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "identical_responses", "chosen and rejected are identical"),
    ({"chosen": [U, A], "rejected": [U, A]}, "identical_responses", "chosen and rejected are identical"),
    ({"chosen": [U, A], "rejected": [m("user", "bye"), B]}, "prompt_mismatch",
     "chosen and rejected share no leading message, so they have no common prompt"),
    ({"chosen": [U, A, m("user", "x"), A], "rejected": [U, A, m("user", "y"), B]}, "prompt_mismatch",
     "chosen and rejected differ at message 2, a 'user' message: their prompts differ"),
    ({"chosen": [U, A], "rejected": [U]}, "empty_response", "rejected has no message after the shared prompt"),
    ({"chosen": "Q: a", "rejected": "Q: b"}, "implicit_text",
     "chosen and rejected are strings with no 'prompt' field: where the prompt ends is ambiguous; add a 'prompt'"),
    ({"prompt": "p", "chosen": "ok\udc80", "rejected": "b"}, "not_utf8",
     "field 'chosen' is not valid UTF-8 (lone surrogate at character 2)"),
    ({"prompt": b"\xff\xfeq", "chosen": "a", "rejected": "b"}, "not_utf8", "field 'prompt' is not valid UTF-8 (byte 0)"),
    ({"prompt": [m("user", "\ud800")], "chosen": [A], "rejected": [B]}, "not_utf8",
     "field 'prompt[0].content' is not valid UTF-8 (lone surrogate at character 0)"),
    ({"prompt": "p", "completions": ["a", "b", "c"], "scores": [1, 2]}, "scores_mismatch",
     "field 'scores' has 2 entries but there are 3 completions"),
    ({"prompt": "p", "completions": ["a", "b"], "ranks": [1, 2, 3]}, "scores_mismatch",
     "field 'ranks' has 3 entries but there are 2 completions"),
    ({"prompt": "p", "completions": ["a", "b"], "scores": [1, "x"]}, "wrong_type", "scores[1] must be a number, got str"),
    ({"prompt": "p", "completions": ["a", "b"], "scores": [1, math.nan]}, "wrong_type",
     "scores[1] is nan, expected a finite number"),
    ({"prompt": "p", "completions": ["a", "b"]}, "missing_field", "missing field 'scores' or 'ranks'"),
    ({"prompt": "p", "completions": ["a", "b"], "scores": [1, 2], "ranks": [2, 1]}, "wrong_type",
     "has both 'scores' and 'ranks'"),
    ({"completions": ["a", "b"], "scores": [1, 2]}, "missing_field", "missing field 'prompt' (required with 'completions')"),
    ({"prompt": "p", "completions": ["a"], "scores": [1]}, "no_preference", "needs at least 2 completions, got 1"),
    ({"prompt": "p", "completions": ["a", "b"], "scores": [2, 2]}, "no_preference",
     "all completions are tied, so there is no preference"),
    ({"prompt": "p", "completions": ["a", "b", "a"], "scores": [3, 2, 1]}, "identical_responses",
     "completions 0 and 2 are identical but ranked differently"),
]


@pytest.mark.parametrize("bad,reason,message", CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_invalid_record_error_policy(tok, bad, reason, message):
    with pytest.raises(InvalidRecordError) as info:
        prepare_examples([GOOD, bad, GOOD], tok, DataOptions(invalid="error"))
    err = info.value
    assert str(err) == f"record 1: {message}"
    # a UserError: the command line prints it as this one line (exit 2); still a ValueError for old callers
    assert "\n" not in str(err) and isinstance(err, UserError) and isinstance(err, ValueError)
    assert (err.index, err.reason) == (1, reason)


@pytest.mark.parametrize("bad,reason,message", CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_invalid_record_skip_policy(tok, bad, reason, message):
    data = prepare_examples([GOOD, bad, GOOD], tok, DataOptions(invalid="skip"))
    rep = data.report
    assert (rep.loaded, rep.kept, dict(rep.skipped)) == (3, 2, {reason: 1})
    assert [ex.source_index for ex in data.examples] == [0, 2]
    assert f"record 1: {message}" in rep.summary()


def test_null_in_a_jsonl_file_is_reported_as_null(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "a", "rejected": null}\n'
                    '{"prompt": "p", "chosen": "a"}\n')
    with pytest.raises(UserError, match=r"^record 1: field 'rejected' is null \(None\)$"):
        prepare_examples(str(path), tok)
    rep = prepare_examples(str(path), tok, DataOptions(invalid="skip")).report
    assert dict(rep.skipped) == {"wrong_type": 1, "missing_field": 1}
    assert rep.skip_examples == {"wrong_type": "record 1: field 'rejected' is null (None)",
                                 "missing_field": "record 2: missing field 'rejected'"}


def test_valid_utf8_bytes_are_decoded(tok):
    rec = {"prompt": "Question:".encode(), "chosen": " Paris.".encode(), "rejected": " Rome."}
    (ex,) = prepare_examples([rec], tok).examples
    assert list(ex.prompt_ids) + list(ex.response_ids[0]) == tok("Question: Paris." + tok.eos_token)["input_ids"]


def test_many_skips_counted_by_reason(tok):
    records = [GOOD, {"prompt": "p"}, {"prompt": "p", "chosen": "a", "rejected": "a"}, {"prompt": "p"}, GOOD]
    rep = prepare_examples(records, tok, DataOptions(invalid="skip")).report
    assert dict(rep.skipped) == {"missing_field": 2, "identical_responses": 1}
    assert rep.loaded == rep.kept + rep.skipped_total + rep.dropped == 5


def test_conversational_data_needs_a_chat_template():
    t = build_tiny_tokenizer(chat_template=False)
    with pytest.raises(UserError, match="the data is conversational but the tokenizer has no chat template"):
        prepare_examples([{"prompt": [U], "chosen": [A], "rejected": [B]}], t)


def test_chat_template_failure_is_a_record_error(tok):
    t = build_tiny_tokenizer()
    t.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}x"
    bad = {"prompt": [m("system", "s")], "chosen": [A], "rejected": [B]}
    with pytest.raises(InvalidRecordError, match=r"^record 0: chat template failed: first message must be user$"):
        prepare_examples([bad], t)
    rep = prepare_examples([bad], t, DataOptions(invalid="skip")).report
    assert dict(rep.skipped) == {"chat_template": 1}


def test_bad_options_are_refused():
    for kw in ({"invalid": "ignore"}, {"overlong": "cut"}, {"truncation_mode": "middle"},
               {"pairs_policy": "random"}, {"max_length": 0}):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            DataOptions(**kw)


def test_overlong_record_is_dropped_named_and_counted(tok):
    """What the old row-limit check asserted, on the real length rule: the over-long record is named with its
    length and the limit, the others are kept with their record numbers, and the drop is counted."""
    short = {"prompt": "Q:", "chosen": " a", "rejected": " b"}
    long = {"prompt": "Q:", "chosen": " Paris is." * 6, "rejected": " b"}
    n = len(tok(long["prompt"] + long["chosen"] + tok.eos_token)["input_ids"])
    data = prepare_examples([short, short, long], tok, DataOptions(max_length=8, overlong="drop"))
    assert [e.source_index for e in data.examples] == [0, 1] and data.report.dropped == 1
    assert data.report.drop_example == f"record 2: prompt + response 0 is {n} tokens, over max_length 8"
    assert data.report.loaded == data.report.kept + data.report.dropped
