"""Synthetic preference data with the length profiles of the paper's six datasets.

The paper (Wang & Hegde, "Accelerating Direct Preference Optimization with Prefix Sharing", arXiv
2410.20305) reports, per dataset, the median overall length (prompt + ONE completion) and the median
prompt/completion ratio. Benchmarks and tests use these profiles instead of downloading the datasets: what
prefix sharing saves depends only on the lengths, never on the token values. The paper's measured
throughputs are in `prefixdpo_tools.bench.paper`.

Assumptions of ours (the paper gives medians only):
- prompt and each response length are lognormal around their medians with the profile's `sigma`
  (0.5 for all six by default: a factor-of-1.65 spread at one sigma), drawn independently, so chosen
  and rejected lengths differ as they do in real data;
- prompt median = median_total * ratio / (1 + ratio), completion median = median_total / (1 + ratio).

Besides the paper's six pairwise profiles, `MULTI_RESPONSE_PROFILES` holds UltraFeedback-like records
with 4 completions per prompt (UltraFeedback rates 4 completions per prompt) trained `best_vs_each`: 3
pairs per record. Prefix sharing runs the prompt and the 4 responses once in one row; standard DPO runs 3
pairs = 6 `[prompt][response]` sequences (the best response 3 times). The paper has no such profile.
`BENCH_PROFILES` is both together, in the benchmark's order.

`SHARED_PREFIX_PROFILES` are records that share more than one record's prompt (none is in the paper):
`shp-like` (SHP: Reddit posts of ~150-400 tokens, each with 5-10 comment pairs, one pair per record, drawn among
a few comments of the post, so a comment appears in several records), `system-prompt` (every record behind the
same ~300-token system prompt, then its own HH-like user prompt and two responses) and `multi-turn` (3-5-turn
dialogues, a pair at each turn: each turn's prompt holds the earlier turns). Records are listed prompt by prompt
(dialogue by dialogue). Their assumptions (ours): prompts uniform in the range, responses lognormal around their median.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from prefixdpo.data.example import Example
from prefixdpo.errors import ConfigError

__all__ = [
    "LengthProfile", "PROFILES", "MULTI_RESPONSE_PROFILES", "BENCH_PROFILES", "PAIRS_POLICIES", "NUM_SPECIAL_IDS",
    "synthetic_lengths", "synthetic_examples", "synthetic_pairs",
    "SharedPrefixProfile", "SHARED_PREFIX_PROFILES", "shared_prefix_examples",
]

# How the K responses of a synthetic record are paired (response 0 is the best, K-1 the worst).
PAIRS_POLICIES = ("best_vs_worst", "best_vs_each")

# Token ids below this are never generated: tokenizers built locally for tests put pad/bos/eos/unk
# at ids 0..3, and a special token inside a prompt or response would change what a model or a
# collator does with it (e.g. an eos cutting a response short).
NUM_SPECIAL_IDS = 4


@dataclass(frozen=True)
class LengthProfile:
    """Length statistics of one preference dataset.

    median_total:            median of prompt + ONE completion, in tokens (HH-RLHF: 186).
    prompt_completion_ratio: median prompt length / median completion length (HH-RLHF: 2.15).
    sigma:                   lognormal shape of each length (our assumption, see module docstring).
    num_responses:           completions per prompt (K); each drawn around median_completion.
    pairs_policy:            how the K responses are paired (`PAIRS_POLICIES`).
    """

    name: str
    median_total: float
    prompt_completion_ratio: float
    sigma: float = 0.5
    num_responses: int = 2
    pairs_policy: str = "best_vs_worst"

    @property
    def median_prompt(self) -> float:
        r = self.prompt_completion_ratio
        return self.median_total * r / (1.0 + r)

    @property
    def median_completion(self) -> float:
        return self.median_total / (1.0 + self.prompt_completion_ratio)


PROFILES: dict[str, LengthProfile] = {
    p.name: p
    for p in (
        LengthProfile("capybara", 1160.0, 1.59),
        LengthProfile("hh-rlhf", 186.0, 2.15),
        LengthProfile("metamath", 872.0, 3.91),
        LengthProfile("tldr", 416.0, 11.14),
        LengthProfile("tulu-helpsteer", 775.0, 6.34),
        LengthProfile("ultrafeedback", 409.0, 0.42),
    )
}

# UltraFeedback's lengths (prompt + one completion, as above), 4 completions per prompt, best vs each other.
MULTI_RESPONSE_PROFILES: dict[str, LengthProfile] = {
    p.name: p
    for p in (LengthProfile("ultrafeedback-k4", 409.0, 0.42, num_responses=4, pairs_policy="best_vs_each"),)
}

BENCH_PROFILES: dict[str, LengthProfile] = {**PROFILES, **MULTI_RESPONSE_PROFILES}


def _get_profile(profile: LengthProfile | str) -> LengthProfile:
    if isinstance(profile, LengthProfile):
        return profile
    try:
        return BENCH_PROFILES[profile]
    except KeyError:
        raise ConfigError(f"unknown length profile {profile!r}; known: {', '.join(BENCH_PROFILES)}") from None


def synthetic_pairs(num_responses: int, policy: str = "best_vs_worst") -> tuple[tuple[int, int], ...]:
    """Preference pairs of a synthetic record whose response 0 is the best and K-1 the worst.

    best_vs_worst: ((0, K-1),); best_vs_each: ((0, 1), ..., (0, K-1)), K-1 pairs.
    """
    if policy == "best_vs_worst":
        return ((0, num_responses - 1),)
    if policy == "best_vs_each":
        return tuple((0, k) for k in range(1, num_responses))
    raise ConfigError(f"unknown pairs policy {policy!r}; known: {', '.join(PAIRS_POLICIES)}")


def synthetic_lengths(
    profile: LengthProfile | str,
    n: int,
    *,
    seed: int = 0,
    num_responses: int | None = None,
    max_length: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and response lengths only (fast: no token ids), as `synthetic_examples` draws them.

    returns: prompt_lengths [n] int64, response_lengths [n, num_responses] int64, all >= 1.

    max_length caps the prefix-SHARED row (prompt + all responses), the thing that gets packed; the
    paper's code capped prompt + the longer response instead and could overflow its pack length. A
    row over the cap has every part scaled down by the same factor (keeping its prompt/response
    shape, as truncation would), then trimmed token by token from the longest part if rounding left it
    over. Requires max_length >= 1 + num_responses. num_responses None = the profile's.
    """
    prof = _get_profile(profile)
    num_responses = prof.num_responses if num_responses is None else num_responses
    if n < 0:
        raise ConfigError(f"n must be >= 0, got {n}")
    if num_responses < 2:
        raise ConfigError(f"num_responses must be >= 2, got {num_responses}")
    if max_length is not None and max_length < 1 + num_responses:
        raise ConfigError(f"max_length {max_length} cannot hold a prompt and {num_responses} one-token responses")
    rng = np.random.default_rng(seed)
    # Prompt first, then all responses, so a profile's prompts do not depend on num_responses.
    prompt = rng.lognormal(math.log(prof.median_prompt), prof.sigma, size=n)
    resp = rng.lognormal(math.log(prof.median_completion), prof.sigma, size=(n, num_responses))
    prompt = np.maximum(np.rint(prompt), 1).astype(np.int64)
    resp = np.maximum(np.rint(resp), 1).astype(np.int64)
    if max_length is not None:
        total = prompt + resp.sum(axis=1)
        over = np.nonzero(total > max_length)[0]
        for i in over.tolist():
            parts = np.concatenate(([prompt[i]], resp[i])).astype(np.float64)
            parts = np.maximum(np.floor(parts * max_length / parts.sum()), 1).astype(np.int64)
            while parts.sum() > max_length:  # only when the floor-at-1 pushed it over: rare, short
                parts[int(np.argmax(parts))] -= 1
            prompt[i], resp[i] = parts[0], parts[1:]
    return prompt, resp


def synthetic_examples(
    profile: LengthProfile | str,
    n: int,
    *,
    vocab_size: int,
    seed: int = 0,
    num_responses: int | None = None,
    max_length: int | None = None,
    pairs_policy: str | None = None,
) -> list[Example]:
    """`n` random Examples whose lengths follow `profile` (see `synthetic_lengths` for the lengths).

    Token ids are uniform in [NUM_SPECIAL_IDS, vocab_size) (ids 0..3 are left to special tokens).
    Preference pairs: response 0 is taken as the best and K-1 as the worst; `synthetic_pairs` with
    pairs_policy (None = the profile's): ((0, K-1),) best vs worst, or best_vs_each's K-1 pairs.
    num_responses None = the profile's.
    source_index is -1 (synthetic); meta records the profile name and the record's number.
    Deterministic given (profile, n, seed, num_responses, max_length, vocab_size, pairs_policy).
    """
    if vocab_size <= NUM_SPECIAL_IDS:
        raise ConfigError(f"vocab_size must exceed {NUM_SPECIAL_IDS} (ids below it are reserved), got {vocab_size}")
    prof = _get_profile(profile)
    num_responses = prof.num_responses if num_responses is None else num_responses
    pairs = synthetic_pairs(num_responses, prof.pairs_policy if pairs_policy is None else pairs_policy)
    prompt_len, resp_len = synthetic_lengths(prof, n, seed=seed, num_responses=num_responses, max_length=max_length)
    # A separate stream for token ids, so the lengths equal synthetic_lengths' for the same seed.
    rng = np.random.default_rng([int(seed), 1])
    tokens = rng.integers(NUM_SPECIAL_IDS, vocab_size, size=int(prompt_len.sum() + resp_len.sum())).tolist()
    out: list[Example] = []
    pos = 0
    for i in range(n):
        p = int(prompt_len[i])
        prompt_ids = tokens[pos : pos + p]
        pos += p
        responses = []
        for r in resp_len[i].tolist():
            responses.append(tokens[pos : pos + r])
            pos += r
        out.append(Example(prompt_ids, responses, pairs, meta={"profile": prof.name, "synthetic_index": i}))
    return out


@dataclass(frozen=True)
class SharedPrefixProfile:
    """Records that share a prompt (several pairs per prompt) or its beginning (a system prompt).

    prompt_range:        (lo, hi) tokens of each prompt after the system prompt, uniform.
    median_response:     median tokens of a response (lognormal with `sigma`).
    responses_per_prompt: (lo, hi) distinct responses of one prompt; its records pair them up.
    pairs_per_prompt:    (lo, hi) records (one pair each) per prompt, each a different two of its responses (at
                         most all of them), better one drawn at random.
    system_length:       tokens of one system prompt in front of every prompt (0: none).
    turns:               (lo, hi) turns of a dialogue: each turn's prompt is the last turn's prompt, the preferred
                         response of its first record and a new user message (`prompt_range` tokens); (1, 1): none.
    """

    name: str
    prompt_range: tuple[int, int]
    median_response: float
    responses_per_prompt: tuple[int, int] = (2, 2)
    pairs_per_prompt: tuple[int, int] = (1, 1)
    system_length: int = 0
    sigma: float = 0.5
    turns: tuple[int, int] = (1, 1)

    @property
    def median_total(self) -> float:
        """System prompt + a middle prompt + one response, what `bench`'s auto length scale compares; in a dialogue
        the middle turn's prompt, which holds the user messages and responses of the turns before it."""
        middle = (sum(self.turns) / 2 + 1) / 2  # turns up to the middle one of a middle-length dialogue
        return (self.system_length + middle * sum(self.prompt_range) / 2 + (middle - 1) * self.median_response
                + self.median_response)

    def scaled(self, scale: float) -> "SharedPrefixProfile":
        """Every length times `scale` (counts of responses and pairs unchanged)."""
        lo, hi = self.prompt_range
        return replace(self, prompt_range=(max(1, round(lo * scale)), max(1, round(hi * scale))),
                       median_response=self.median_response * scale,
                       system_length=round(self.system_length * scale))


SHARED_PREFIX_PROFILES: dict[str, SharedPrefixProfile] = {
    p.name: p
    for p in (
        SharedPrefixProfile("shp-like", (150, 400), 80.0, responses_per_prompt=(4, 7), pairs_per_prompt=(5, 10)),
        SharedPrefixProfile("system-prompt", (40, 200), 60.0, system_length=300),
        SharedPrefixProfile("multi-turn", (30, 150), 120.0, turns=(3, 5)),
    )
}


def shared_prefix_examples(profile: SharedPrefixProfile | str, n_prompts: int, *, vocab_size: int, seed: int = 0
                           ) -> list[Example]:
    """Records of `n_prompts` prompts of `profile`, prompt by prompt: each record one pair (two responses), its
    `source_index` its number in the list, `meta` {"profile", "prompt": the prompt's number}.

    A prompt's records pick distinct pairs among its responses (a response in several records); the
    system prompt, if any, is the same tokens in front of every prompt. Deterministic given the arguments.
    """
    if isinstance(profile, str):
        if profile not in SHARED_PREFIX_PROFILES:
            raise ConfigError(f"unknown profile {profile!r}; known: {', '.join(SHARED_PREFIX_PROFILES)}")
        profile = SHARED_PREFIX_PROFILES[profile]
    if vocab_size <= NUM_SPECIAL_IDS:
        raise ConfigError(f"vocab_size must exceed {NUM_SPECIAL_IDS} (ids below it are reserved), got {vocab_size}")
    rng = np.random.default_rng([int(seed), 2])

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.integers(NUM_SPECIAL_IDS, vocab_size, size=int(n)).tolist())

    def response_length() -> int:
        return max(1, int(round(rng.lognormal(math.log(profile.median_response), profile.sigma))))

    def user_message() -> tuple[int, ...]:
        return tokens(rng.integers(profile.prompt_range[0], profile.prompt_range[1] + 1))

    system = tokens(profile.system_length)
    out: list[Example] = []
    for prompt_number in range(n_prompts):
        prompt = system + user_message()
        lo, hi = profile.turns
        n_pairs = 0  # the last turn's record count (set by turn 0 before a later turn reads it)
        for turn in range(lo if lo == hi else int(rng.integers(lo, hi + 1))):
            if turn:  # the dialogue goes on after the preferred response of the last turn's first record
                prompt = prompt + out[-n_pairs].response_ids[0] + user_message()
            k = int(rng.integers(profile.responses_per_prompt[0], profile.responses_per_prompt[1] + 1))
            responses = [tokens(response_length()) for _ in range(k)]
            candidates = [(i, j) for i in range(k) for j in range(i + 1, k)]
            n_pairs = min(len(candidates), int(rng.integers(*profile.pairs_per_prompt, endpoint=True)))
            for choice in rng.choice(len(candidates), size=n_pairs, replace=False).tolist():
                i, j = candidates[choice] if rng.random() < 0.5 else candidates[choice][::-1]  # which one was preferred
                meta = {"profile": profile.name, "prompt": prompt_number}
                if hi > 1:
                    meta["turn"] = turn
                out.append(Example(prompt, (responses[i], responses[j]), ((0, 1),), len(out), meta))
    return out
