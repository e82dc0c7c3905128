"""max_length per sequence (TRL 1.16's rule), pairs policies, and the report: every loaded record is accounted for."""

from __future__ import annotations

import pytest

from prefixdpo.data.formats import preference_pairs
from prefixdpo.data.prepare import DataOptions, prepare_examples
from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
from prefixdpo.data.truncate import TRUNCATION_MODES, truncate_row


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


P10 = list(range(100, 110))


def lens(result):
    return len(result.prompt), [len(r) for r in result.responses], result.status


def test_sequences_that_fit_are_untouched_even_when_the_row_is_longer():
    # Row 10 + 8 + 9 = 27 > 20, but each prompt + response (18, 19) fits: TRL would cut nothing.
    for mode in TRUNCATION_MODES:
        out = truncate_row(P10, [[1] * 8, [2] * 9], max_length=20, truncation_mode=mode)
        assert lens(out) == (10, [8, 9], "kept")
        assert truncate_row(P10, [[1] * 8, [2] * 9], max_length=20, truncation_mode=mode, overlong="drop").status == "kept"
    assert truncate_row(P10, [[1] * 50, [2]], max_length=None).status == "kept"


def test_keep_start_cuts_response_ends_and_drops_a_prompt_that_fills_max_length():
    out = truncate_row(P10, [list(range(8)), [2] * 3], max_length=15, truncation_mode="keep_start")
    assert out.prompt == P10 and out.responses == [list(range(5)), [2] * 3] and out.status == "truncated"
    for limit in (10, 9):  # TRL's filter: prompt_ids must be shorter than max_length
        out = truncate_row(P10, [[1], [2]], max_length=limit, truncation_mode="keep_start")
        assert out.status == "dropped"
        assert out.problem == f"prompt of 10 tokens leaves no room within max_length {limit}"


def test_keep_end_cuts_the_shared_prompt_by_what_the_longest_sequence_needs():
    out = truncate_row(P10, [[1] * 8, [2] * 3], max_length=12, truncation_mode="keep_end")
    # The longest sequence (10 + 8) is 6 over: the prompt loses its first 6 tokens, responses stay whole.
    assert out.prompt == P10[6:] and out.responses == [[1] * 8, [2] * 3] and out.status == "truncated"


def test_keep_end_response_alone_over_max_length_keeps_the_tokens_trl_scores():
    long = list(range(30))
    out = truncate_row(P10, [long, [2] * 3], max_length=20, truncation_mode="keep_end")
    # TRL's sequence is long[-20:], whose first token is never scored: scored tokens long[-19:] either way.
    assert out.prompt == P10[-1:] and out.responses == [long[-19:], [2] * 3] and out.status == "truncated"
    out = truncate_row(P10, [list(range(20)), [2]], max_length=20, truncation_mode="keep_end")  # exactly max_length
    assert out.prompt == P10[-1:] and out.responses == [list(range(1, 20)), [2]]
    out = truncate_row(P10, [[1] * 3, [2]], max_length=1, truncation_mode="keep_end")
    assert out.status == "dropped" and out.problem == "max_length 1 leaves no response token to score"


def test_overlong_drop():
    out = truncate_row(P10, [[1] * 5, [2] * 11], max_length=20, overlong="drop")
    assert out.status == "dropped" and out.problem == "prompt + response 1 is 21 tokens, over max_length 20"
    assert truncate_row(P10, [[1] * 5, [2] * 10], max_length=20, overlong="drop").status == "kept"


def test_every_sequence_fits_after_truncation():
    for mode in TRUNCATION_MODES:
        for p in (1, 5, 40):
            for r in ((1, 1), (30, 2), (50, 50, 50)):
                for limit in (2, 8, 16, 64):
                    out = truncate_row(list(range(p)), [[1] * n for n in r], max_length=limit, truncation_mode=mode)
                    if out.status != "dropped":
                        assert out.prompt and all(out.responses)
                        assert all(len(out.prompt) + len(x) <= limit for x in out.responses), (mode, p, r, limit)
                    else:
                        assert mode == "keep_start" and p >= limit


def test_prepare_counts_truncated_and_dropped(tok):
    short = {"prompt": "Q:", "chosen": " a", "rejected": " b"}
    long = {"prompt": "Question: what is the capital of France? " * 4, "chosen": " Paris is." * 6, "rejected": " Rome."}
    records = [short, long, short]
    p = len(tok(long["prompt"])["input_ids"])
    limit = p + 10
    data = prepare_examples(records, tok, DataOptions(max_length=limit))
    rep = data.report
    assert (rep.loaded, rep.kept, rep.truncated, rep.dropped) == (3, 3, 1, 0)
    ex = data.examples[1]
    assert ex.meta["truncated"] and len(ex.prompt_ids) == p
    rejected_full = len(tok(long["prompt"] + long["rejected"] + tok.eos_token)["input_ids"])
    assert rejected_full < limit and [len(ex.prompt_ids) + len(r) for r in ex.response_ids] == [limit, rejected_full]
    assert "Truncated 1." in rep.summary()
    rep = prepare_examples(records, tok, DataOptions(max_length=limit, overlong="drop")).report
    assert (rep.kept, rep.truncated, rep.dropped) == (2, 0, 1)
    assert rep.summary().endswith(f"Dropped 1 over max_length (e.g. record 1: prompt + response 0 is "
                                  f"{len(tok(long['prompt'] + long['chosen'] + tok.eos_token)['input_ids'])} tokens, "
                                  f"over max_length {limit}).")
    data = prepare_examples(records, tok, DataOptions(max_length=p))
    assert [e.source_index for e in data.examples] == [0, 2] and data.report.dropped == 1
    assert f"(e.g. record 1: prompt of {p} tokens leaves no room within max_length {p})" in data.report.summary()


def test_row_longer_than_max_length_is_kept_whole(tok):
    rec = {"prompt": "Question: what is the capital of France? Answer:", "chosen": " Paris is." * 3, "rejected": " Rome is." * 3}
    (full,) = prepare_examples([rec], tok, DataOptions(max_length=None)).examples
    longest = max(len(full.prompt_ids) + len(r) for r in full.response_ids)
    assert full.shared_length > longest
    data = prepare_examples([rec], tok, DataOptions(max_length=longest))
    (ex,) = data.examples
    assert ex == full and ex.shared_length > longest and data.report.truncated == 0 and "truncated" not in ex.meta


def _trl_sequences(records, tokenizer, max_length, truncation_mode):
    """TRL 1.16's own preprocessing: `DPOTrainer._prepare_dataset` (tokenize, filter), then the collator's cut.
    Returns per record None (TRL filtered it out) or [prompt+chosen ids, prompt+rejected ids] as it trains on them."""
    import types

    datasets = pytest.importorskip("datasets")
    dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode=truncation_mode)
    stub = types.SimpleNamespace(_tokenizer=tokenizer)
    collator = dpo.DataCollatorForPreference(pad_token_id=0, max_length=max_length, truncation_mode=truncation_mode)
    out = []
    for rec in records:
        rows = dpo.DPOTrainer._prepare_dataset(stub, datasets.Dataset.from_list([rec]), tokenizer, args, "train")
        if len(rows) == 0:
            out.append(None)
            continue
        batch = collator.torch_call([{k: rows[0][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}])
        out.append([ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])])
    return out


TRL_RECORDS = [
    {"prompt": "Question: what is the capital of France? Answer:", "chosen": " Paris is." * 5, "rejected": " Rome."},
    {"prompt": "Q:", "chosen": " a", "rejected": " b"},
    {"prompt": "Question: and Italy? " * 8, "chosen": " Rome.", "rejected": " Paris is." * 2},
]


@pytest.mark.parametrize("truncation_mode", TRUNCATION_MODES)
def test_truncated_ids_equal_trl_preprocessing(tok, truncation_mode):
    """Token ids after truncation equal TRL 1.16's for the same records and options. keep_start: every
    sequence. keep_end: the longest sequence of a record; the shorter one is a suffix of TRL's (one shared
    prompt, cut as the longest needs; see `truncate`)."""
    max_length = 24
    trl = _trl_sequences(TRL_RECORDS, tok, max_length, truncation_mode)
    data = prepare_examples(TRL_RECORDS, tok, DataOptions(max_length=max_length, truncation_mode=truncation_mode))
    ours = {ex.source_index: [list(ex.prompt_ids) + list(r) for r in ex.response_ids] for ex in data.examples}
    # The records exercise: a cut, no cut, and (keep_start) a prompt that fills max_length.
    assert [ex.meta.get("truncated", False) for ex in data.examples][:2] == [True, False]
    assert (trl[2] is None) == (truncation_mode == "keep_start") == (2 not in ours)
    for i, trl_seqs in enumerate(trl):
        if trl_seqs is None:
            continue
        longest = max(range(2), key=lambda k: len(ours[i][k]))  # the longest response: its prompt is cut the most
        assert ours[i][longest] == trl_seqs[longest], (i, truncation_mode)
        for k in range(2):
            if truncation_mode == "keep_start":
                assert ours[i][k] == trl_seqs[k]
            else:
                assert trl_seqs[k][len(trl_seqs[k]) - len(ours[i][k]):] == ours[i][k]
            assert len(ours[i][k]) <= max_length


def test_preference_pairs_policies():
    scores = [1.0, 3.0, 2.0, 3.0]  # a tie for best: the first best is used
    assert preference_pairs(scores, "best_vs_worst") == [(1, 0)]
    assert preference_pairs(scores, "best_vs_each") == [(1, 0), (1, 2)]
    assert sorted(preference_pairs(scores, "all_pairs")) == [(1, 0), (1, 2), (2, 0), (3, 0), (3, 2)]
    assert preference_pairs([2.0, 2.0], "all_pairs") == []


def test_multi_response_one_example_per_prompt(tok):
    rec = {"prompt": "Q:", "completions": [" a", " b", " c", " d"], "scores": [1, 4, 2, 0]}
    data = prepare_examples([rec], tok, DataOptions(pairs_policy="best_vs_worst"))
    (ex,) = data.examples
    # Only the used responses (best = 1, worst = 3) go into the row; the two others are counted as unused.
    assert ex.num_responses == 2 and ex.pairs == ((0, 1),) and ex.meta["scores"] == (4.0, 0.0)
    assert tok.decode(ex.response_ids[0]).startswith(" b") and data.report.unused_responses == 2
    (ex,) = prepare_examples([rec], tok, DataOptions(pairs_policy="best_vs_each")).examples
    assert ex.num_responses == 4 and ex.pairs == ((1, 0), (1, 2), (1, 3))
    (ex,) = prepare_examples([rec], tok, DataOptions(pairs_policy="all_pairs")).examples
    assert len(ex.pairs) == 6 and ex.num_responses == 4


def test_summary_mentions_formats_and_boundary(tok):
    recs = [{"prompt": "Answer: ", "chosen": "Paris", "rejected": "Rome"},
            {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yo"}],
             "rejected": [{"role": "assistant", "content": "no"}]}]
    text = prepare_examples(recs, tok).report.summary()
    assert text.startswith("Loaded 2 records, kept 2 examples (1 conversational, 1 standard).")
    assert "1 prompts tokenize differently alone" in text
