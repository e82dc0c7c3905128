"""Benchmark workloads: the examples every mode runs, and their fixed split into optimizer steps.

A workload is a list of `Example`s in a fixed order plus `groups`: consecutive runs of
`examples_per_step` example indices. Every mode lays out / packs the SAME group for one optimizer step,
so all four modes do the same number of steps on the same examples in the same order.

Synthetic workloads follow the paper's six length profiles (`prefixdpo.data.synthetic.PROFILES`:
median overall length, prompt/completion ratio, lognormal spread, seeded), or a multi-response one
(`MULTI_RESPONSE_PROFILES`: 4 completions per prompt, best vs each: 3 pairs per example). `length_scale` < 1
shrinks both medians by the same factor (the prompt/completion ratio, hence the token saving, is
kept): the default and quick runs use it to fit a CPU time budget, and the report states it.

Shared-prefix workloads (`SHARED_PREFIX_PROFILES`: `shp-like`, several pair records per prompt; `system-prompt`,
one system prompt in front of every record) hold records; a step holds the records of whole prompts, so the
grouped mode (`modes.GROUPED_MODE`) can put a prompt's records in one row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from prefixdpo.data.example import Example
from prefixdpo.data.synthetic import (
    BENCH_PROFILES, SHARED_PREFIX_PROFILES, LengthProfile, SharedPrefixProfile, shared_prefix_examples,
    synthetic_examples,
)
from prefixdpo.errors import UserError

__all__ = ["Workload", "scaled_profile", "synthetic_workload", "shared_prefix_workload", "dataset_workload",
           "fixed_groups"]


@dataclass
class Workload:
    """What one benchmark profile runs.

    examples: [N] in run order; groups: lists of example indices, one optimizer step each.
    profile:  the paper's length profile (`bench.paper.PAPER[profile.name]` goes beside ours), None for a real dataset.
    length_scale: factor applied to the profile's median lengths (1.0 = the paper's lengths).
    """

    name: str
    examples: list[Example]
    groups: list[list[int]]
    profile: LengthProfile | SharedPrefixProfile | None = None
    length_scale: float = 1.0
    source: str = "synthetic"
    notes: list[str] = field(default_factory=list)

    @property
    def num_pairs(self) -> int:
        return sum(len(ex.pairs) for ex in self.examples)


def fixed_groups(n_examples: int, examples_per_step: int) -> list[list[int]]:
    """Consecutive groups of `examples_per_step` indices; the last may be shorter (nothing dropped)."""
    if examples_per_step < 1:
        raise UserError(f"examples_per_step must be >= 1, got {examples_per_step}")
    return [list(range(k, min(k + examples_per_step, n_examples))) for k in range(0, n_examples, examples_per_step)]


def scaled_profile(profile: LengthProfile, scale: float) -> LengthProfile:
    """The profile with its median overall length times `scale` (ratio and spread unchanged)."""
    if not scale > 0:
        raise UserError(f"length scale must be positive, got {scale}")
    return replace(profile, median_total=profile.median_total * scale)


def synthetic_workload(
    name: str,
    n_examples: int,
    examples_per_step: int,
    *,
    vocab_size: int,
    seed: int = 0,
    length_scale: float = 1.0,
    max_length: int | None = None,
    num_responses: int | None = None,
) -> Workload:
    """`n_examples` seeded synthetic examples of the named profile (`BENCH_PROFILES`), grouped into steps.

    num_responses: None = the profile's (2, or 4 for the multi-response profile)."""
    if name not in BENCH_PROFILES:
        raise UserError(f"unknown profile {name!r}; known: {', '.join(BENCH_PROFILES)}")
    prof = BENCH_PROFILES[name]
    examples = synthetic_examples(
        scaled_profile(prof, length_scale), n_examples, vocab_size=vocab_size, seed=seed,
        num_responses=num_responses, max_length=max_length,
    )
    return Workload(name, examples, fixed_groups(len(examples), examples_per_step), prof, length_scale)


def shared_prefix_workload(name: str, n_prompts: int, prompts_per_step: int, *, vocab_size: int, seed: int = 0,
                           length_scale: float = 1.0) -> Workload:
    """The records of `n_prompts` prompts of the named `SHARED_PREFIX_PROFILES` profile, lengths times
    `length_scale`; each optimizer step holds the records of `prompts_per_step` whole prompts."""
    if name not in SHARED_PREFIX_PROFILES:
        raise UserError(f"unknown profile {name!r}; known: {', '.join(SHARED_PREFIX_PROFILES)}")
    if prompts_per_step < 1:
        raise UserError(f"prompts per step must be >= 1, got {prompts_per_step}")
    profile = SHARED_PREFIX_PROFILES[name]
    examples = shared_prefix_examples(profile.scaled(length_scale), n_prompts, vocab_size=vocab_size, seed=seed)
    groups: list[list[int]] = []
    for i, ex in enumerate(examples):
        step = ex.meta["prompt"] // prompts_per_step
        if not groups or step != examples[groups[-1][0]].meta["prompt"] // prompts_per_step:
            groups.append([])
        groups[-1].append(i)
    return Workload(name, examples, groups, profile, length_scale)


def dataset_workload(
    dataset: str,
    tokenizer_name: str,
    n_examples: int,
    examples_per_step: int,
    *,
    split: str = "train",
    max_length: int | None = None,
    vocab_size: int | None = None,
    trust_remote_code: bool = False,
) -> Workload:
    """A real dataset through the real data pipeline (`prefixdpo.data.prepare.prepare_examples`).

    vocab_size: the benchmark model's vocabulary; token ids at or above it are an error (a real
    tokenizer needs a real model, `--model`, or a default model with a big enough vocabulary).
    """
    try:
        from prefixdpo.data.prepare import DataOptions, prepare_examples
    except ImportError as err:  # the data pipeline is optional for synthetic runs
        raise ValueError(f"--dataset needs prefixdpo.data.prepare, which is not available: {err}") from None
    from prefixdpo.core.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_name, trust_remote_code=trust_remote_code)
    options = DataOptions(max_length=max_length, max_samples=n_examples, split=split, invalid="skip")
    prepared = prepare_examples(dataset, tokenizer, options)
    examples = list(prepared.examples)
    if not examples:
        raise UserError(f"dataset {dataset!r}: no usable examples ({prepared.report.summary()})")
    if vocab_size is not None:
        for i, ex in enumerate(examples):
            top = max(max(ex.prompt_ids), *(max(r) for r in ex.response_ids))
            if top >= vocab_size:
                raise UserError(
                    f"record {ex.source_index if ex.source_index >= 0 else i}: token id {top} >= the model's "
                    f"vocabulary {vocab_size}; pass --model with this tokenizer's model"
                )
    name = dataset.rstrip("/").split("/")[-1]
    return Workload(name, examples, fixed_groups(len(examples), examples_per_step), None, 1.0, "dataset",
                    [prepared.report.summary()])
