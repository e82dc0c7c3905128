"""`ParsedRecord` -> prompt ids + K response ids, boundary-safe and identical to TRL 1.16's DPOTrainer.

The rule (TRL's `_prepare_dataset.tokenize_fn`): tokenize the prompt alone (`p`) and each full sequence
prompt+response (`f_k`) exactly as a user's tokenizer would; the prompt is the longest prefix of `p` that
every `f_k` starts with, and response k is the rest of `f_k`. So `prompt_ids + response_ids[k] == f_k` token
for token, for every k: nothing dropped, nothing duplicated, whatever happens at the boundary.

When a BPE merge crosses the boundary (prompt "Answer: " + response "Paris" tokenizes as "Answer:" "ĠParis",
not "Answer:" "Ġ" "Paris"), or a chat template renders the prompt alone differently, the tail of `p` that
the full sequences do not share is moved into the responses, all responses share the same prompt ids, and
the number of moved tokens is reported (`boundary_adjusted`).

How each piece is tokenized (as TRL, so a user switching gets the same ids):
- text:  `tokenizer(prompt)` and `tokenizer(prompt + response)` with the tokenizer's default special tokens
         (BOS for most); EOS text is appended to each response first unless it already ends with it.
- chat:  `apply_chat_template(prompt, add_generation_prompt=True)` and `apply_chat_template(prompt + response)`
         rendered to text, then tokenized with `add_special_tokens=False` (the template writes BOS itself);
         no EOS is added (the template ends the turn).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixdpo.data.formats import ParsedRecord
from prefixdpo.data.validation import BOUNDARY, InvalidRecordError
from prefixdpo.errors import UserError

CHAT_TEMPLATE = "chat_template"


@dataclass
class TokenizedRecord:
    """prompt_ids: P ids; response_ids: K lists of ids; boundary_adjusted: prompt tokens moved into the responses."""

    index: int
    prompt_ids: list[int]
    response_ids: list[list[int]]
    boundary_adjusted: int = 0


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def split_at_boundary(index: int, prompt_ids: list[int], full_ids: list[list[int]]) -> TokenizedRecord:
    """Split each full sequence after the longest prompt prefix they all share (see module docstring)."""
    prompt_len = min(common_prefix_length(prompt_ids, f) for f in full_ids)
    if prompt_len == 0:
        raise InvalidRecordError(index, BOUNDARY, "no prompt token survives the prompt/response boundary")
    responses = [list(f[prompt_len:]) for f in full_ids]
    for k, r in enumerate(responses):
        if not r:
            raise InvalidRecordError(index, BOUNDARY, f"response {k} has no token after the prompt")
    return TokenizedRecord(index, list(prompt_ids[:prompt_len]), responses, len(prompt_ids) - prompt_len)


def _render(record: ParsedRecord, tokenizer, eos: str | None) -> list[str]:
    """Texts to tokenize for one record: [prompt, prompt+response_1, ..., prompt+response_K]."""
    if record.kind == "text":
        responses = record.responses
        if eos is not None:
            responses = [r if r.endswith(eos) else r + eos for r in responses]
        return [record.prompt] + [record.prompt + r for r in responses]
    try:
        prompt = tokenizer.apply_chat_template(record.prompt, add_generation_prompt=True, tokenize=False)
        full = [tokenizer.apply_chat_template(record.prompt + r, tokenize=False) for r in record.responses]
    except Exception as err:  # template errors (e.g. "roles must alternate") are about this record
        problem = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise InvalidRecordError(record.index, CHAT_TEMPLATE, f"chat template failed: {problem}") from None
    return [prompt] + full


def tokenize_records(
    records: list[ParsedRecord], tokenizer, add_eos: bool = True
) -> list[TokenizedRecord | InvalidRecordError]:
    """Tokenize records in batches (fast tokenizers encode a list much faster than one text at a time).

    Returns one entry per record, in order: a `TokenizedRecord`, or the `InvalidRecordError` for that record
    (the caller applies the error/skip policy).
    """
    if any(r.kind == "chat" for r in records) and not getattr(tokenizer, "chat_template", None):
        raise UserError("the data is conversational but the tokenizer has no chat template: add a chat_template.jinja "
                        "to the tokenizer's folder (or set tokenizer.chat_template in Python)")
    eos = None
    if add_eos and any(r.kind == "text" for r in records):
        eos = tokenizer.eos_token
        if eos is None:
            # Advice names only what exists: the tokenizer's own setting, `prefixdpo reward --eos_token`, and
            # the Python API's DataOptions(add_eos=False); `prefixdpo train` has no option for it (TRL has none).
            raise UserError("the tokenizer has no eos_token to end each text response with (as TRL does): set "
                            "eos_token in its tokenizer_config.json (prefixdpo reward: --eos_token), give the data "
                            "as conversations (the chat template ends each turn), or in Python pass "
                            "DataOptions(add_eos=False)")

    rendered: list[list[str] | InvalidRecordError] = []
    for record in records:
        try:
            rendered.append(_render(record, tokenizer, eos))
        except InvalidRecordError as err:
            rendered.append(err)

    ids: dict[tuple[int, int], list[int]] = {}
    for kind, special in (("text", True), ("chat", False)):
        keys, texts = [], []
        for r, (record, texts_r) in enumerate(zip(records, rendered)):
            if record.kind == kind and not isinstance(texts_r, InvalidRecordError):
                keys += [(r, k) for k in range(len(texts_r))]
                texts += texts_r
        if texts:
            encoded = tokenizer(texts, add_special_tokens=special)["input_ids"]
            ids.update(zip(keys, encoded))

    out: list[TokenizedRecord | InvalidRecordError] = []
    for r, (record, texts_r) in enumerate(zip(records, rendered)):
        if isinstance(texts_r, InvalidRecordError):
            out.append(texts_r)
            continue
        seqs = [ids[(r, k)] for k in range(len(texts_r))]
        try:
            out.append(split_at_boundary(record.index, seqs[0], seqs[1:]))
        except InvalidRecordError as err:
            out.append(err)
    return out
