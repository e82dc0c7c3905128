"""The public entry point: `prepare_examples(source, tokenizer, options) -> PreparedData`.

records -> validate (`formats`) -> tokenize, boundary-safe (`tokenize`) -> `max_length` per sequence (`truncate`)
-> `Example`s,
with every record accounted for in the `DataReport`:

    loaded == kept + skipped (by reason) + dropped (overlong)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from prefixdpo.data.example import Example
from prefixdpo.data.formats import PAIRS_POLICIES, parse_record
from prefixdpo.data.loading import load_records
from prefixdpo.data.record_lines import DEFAULT_MAX_RECORD_BYTES, check_max_record_bytes
from prefixdpo.data.tokenize import tokenize_records
from prefixdpo.data.truncate import OVERLONG_POLICIES, TRUNCATION_MODES, truncate_row
from prefixdpo.data.validation import InvalidRecordError, SkipLog, check_policy, check_record_size, handle
from prefixdpo.errors import ConfigError

_CHUNK = 1024  # records tokenized per batch call


@dataclass
class DataOptions:
    """How records become examples. Names follow TRL's DPOConfig where it has the option.

    max_length:        tokens in each `[prompt][response k]` sequence, as TRL 1.16 (the shared row may be
                       longer); None = no limit. `PrefixDPOConfig` defaults it to TRL's 1024.
    truncation_mode:   "keep_start" (TRL's default: cut responses' ends; drop an example whose prompt fills
                       max_length) or "keep_end" (cut the prompt's start); see `truncate`.
    overlong:          ours: "truncate" or "drop" (examples with a sequence over max_length).
    invalid:           "error" (raise `InvalidRecordError` on the first bad record) or "skip" (count it).
    pairs_policy:      multi-response records: "best_vs_worst" | "best_vs_each" | "all_pairs".
    max_samples:       use the first N records of the split.
    split, eval_split: split names; eval_split None = no eval set.
    add_eos:           append the EOS token text to string responses (as TRL); chat templates end turns themselves.
    dataset_config:    Hub dataset configuration name.
    max_record_bytes:  the most bytes of one record (0: no limit): a larger one is refused, or skipped and counted
                       as `too_big` with invalid="skip": a JSON Lines line before it is parsed (`record_lines`), a
                       record of any other source by its text before it is tokenized (`check_record_size`).
    """

    max_length: int | None = None
    truncation_mode: str = "keep_start"
    overlong: str = "truncate"
    invalid: str = "error"
    pairs_policy: str = "best_vs_worst"
    max_samples: int | None = None
    split: str = "train"
    eval_split: str | None = None
    add_eos: bool = True
    dataset_config: str | None = None
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES

    def __post_init__(self) -> None:
        check_policy(self.invalid)
        check_max_record_bytes(self.max_record_bytes)
        for name, value, allowed in (
            ("truncation_mode", self.truncation_mode, TRUNCATION_MODES),
            ("overlong", self.overlong, OVERLONG_POLICIES),
            ("pairs_policy", self.pairs_policy, PAIRS_POLICIES),
        ):
            if value not in allowed:
                raise ConfigError(f"{name}={value!r}: expected one of {allowed}")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"max_length must be >= 1, got {self.max_length}")


@dataclass
class DataReport:
    """What happened to every loaded record.

    loaded:   records read from the split (after max_samples).
    kept:     examples produced.
    skipped:  invalid records by reason (only with invalid="skip").
    dropped:  valid examples dropped for length (overlong="drop", or a prompt that fills max_length).
    drop_example: the first drop's message, `record <index>: <why>`.
    truncated: kept examples with a sequence cut to max_length.
    boundary_adjusted: kept examples whose prompt, tokenized alone, ends differently from the full sequences
              (a BPE merge across the boundary, or a chat template rendering the prompt alone differently);
              the prompt is cut where they diverge and the responses carry the merged tokens.
    boundary_tokens: total prompt tokens so cut.
    unused_responses: multi-response completions no pair of the policy uses (left out of the rows).
    formats:  kept examples by record format.
    """

    loaded: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    skip_examples: dict[str, str] = field(default_factory=dict)
    dropped: int = 0
    drop_example: str = ""
    truncated: int = 0
    boundary_adjusted: int = 0
    boundary_tokens: int = 0
    unused_responses: int = 0
    formats: Counter = field(default_factory=Counter)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        """One short paragraph for logs and the CLI."""
        fmts = ", ".join(f"{n} {f}" for f, n in sorted(self.formats.items())) or "none"
        parts = [f"Loaded {self.loaded} records, kept {self.kept} examples ({fmts})."]
        if self.skipped:
            reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.skipped.items()))
            first = next(iter(sorted(self.skip_examples.items())))[1]
            parts.append(f"Skipped {self.skipped_total} invalid ({reasons}; e.g. {first}).")
        if self.dropped:
            parts.append(f"Dropped {self.dropped} over max_length (e.g. {self.drop_example}).")
        if self.truncated:
            parts.append(f"Truncated {self.truncated}.")
        if self.boundary_adjusted:
            parts.append(
                f"{self.boundary_adjusted} prompts tokenize differently alone than followed by a response (a token "
                f"merge across the boundary, or the chat template): they were cut where the sequences diverge "
                f"({self.boundary_tokens} tokens), so ids equal a full tokenization."
            )
        if self.unused_responses:
            parts.append(f"{self.unused_responses} completions were not used by the pairs policy.")
        return " ".join(parts)


@dataclass
class PreparedData:
    """examples: the training split; report: its accounting; eval_examples/eval_report: the eval split, if asked."""

    examples: list[Example]
    report: DataReport
    eval_examples: list[Example] | None = None
    eval_report: DataReport | None = None


def examples_from_records(records, tokenizer, options: DataOptions) -> tuple[list[Example], DataReport]:
    """Records (an indexable sequence of dicts) -> examples + report, applying every policy in `options`."""
    report = DataReport(loaded=len(records))
    skips = SkipLog()
    examples: list[Example] = []
    for start in range(0, len(records), _CHUNK):
        parsed = []
        for index in range(start, min(start + _CHUNK, len(records))):
            try:
                record = records[index]
                check_record_size(index, record, options.max_record_bytes)
                parsed.append(parse_record(index, record, options.pairs_policy))
            except InvalidRecordError as err:
                handle(err, options.invalid, skips)
        for record, tok in zip(parsed, tokenize_records(parsed, tokenizer, add_eos=options.add_eos)):
            if isinstance(tok, InvalidRecordError):
                handle(tok, options.invalid, skips)
                continue
            limited = truncate_row(
                tok.prompt_ids, tok.response_ids, options.max_length, options.truncation_mode, options.overlong
            )
            if limited.status == "dropped":
                report.dropped += 1
                report.drop_example = report.drop_example or f"record {record.index}: {limited.problem}"
                continue
            meta = {"format": record.format}
            if record.scores is not None:
                meta["scores"] = tuple(record.scores)
            if tok.boundary_adjusted:
                meta["boundary_adjusted"] = tok.boundary_adjusted
                report.boundary_adjusted += 1
                report.boundary_tokens += tok.boundary_adjusted
            if limited.status == "truncated":
                meta["truncated"] = True
                report.truncated += 1
            examples.append(Example(limited.prompt, limited.responses, tuple(record.pairs), record.index, meta))
            report.formats[record.format] += 1
            report.unused_responses += record.unused
    report.kept = len(examples)
    report.skipped = skips.counts
    report.skip_examples = skips.first_message
    assert report.loaded == report.kept + report.skipped_total + report.dropped, "a record was lost uncounted"
    return examples, report


def prepare_examples(source, tokenizer, options: DataOptions | None = None) -> PreparedData:
    """Load `source` (see `loading.load_records`), validate, tokenize and limit it into `Example`s.

    Raises `InvalidRecordError` (a ValueError, one line naming the record) on the first bad record when
    `options.invalid == "error"`; with "skip" every bad record is counted in `report.skipped`.
    """
    options = options or DataOptions()
    records = load_records(source, options.split, options.dataset_config, options.max_samples,
                           options.max_record_bytes)
    examples, report = examples_from_records(records, tokenizer, options)
    prepared = PreparedData(examples, report)
    if options.eval_split is not None:
        eval_records = load_records(source, options.eval_split, options.dataset_config, options.max_samples,
                                    options.max_record_bytes)
        prepared.eval_examples, prepared.eval_report = examples_from_records(eval_records, tokenizer, options)
    return prepared
