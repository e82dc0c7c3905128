"""`prefixdpo bench --task grpo`: the whole GRPO step, generation + reward-model scoring + the training part, TRL's
way and prefixdpo's, on the same rollouts, interleaved.

The phases, each as the trainers run it:

    generation  TRL: transformers `generate` on the N left-padded prompt rows with TRL's GenerationConfig (sampling,
                KV cache) on the model's stock attention, every prompt prefilled G times. prefixdpo: the same call
                routed as `PrefixGRPOTrainer` routes it (`grpo.generation`), on prefixdpo's attention as the policy
                runs: each unique prompt prefilled once, its keys and values held once and read by its rows'
                decode steps (`core.attention.shared_prompt`). Both generate exactly K new tokens (min_new_tokens =
                K: a batch runs to its longest completion, and every rollout has one cut at the limit).
    scoring     a reward model of the policy's shape (random Llama-shaped sequence classifier) scoring the N rows
                `prompt + completion`: TRL's call on right-padded rows (stock SDPA), prefixdpo's on shared token
                tries (`grpo.reward_models`, the bench's attention backend).
    training    `bench.grpo`'s step: TRL's passes vs the prefix-shared packed ones.

Ideals, per phase, of what sharing can save: the prefill's FLOPs (TRL: N x P slots through the body, N x P x P
query-key pairs; prefixdpo: U x (P - 1) slots and (P - 1)^2 pairs per unique prompt, then the last prompt column of
every row inside `generate`); the decode steps compute the same FLOPs on both sides, so the generation ideal weighs
TRL's measured prefill time at the prefill's FLOP ratio and the rest at 1.00. Scoring: TRL's
rows as run (every padded slot, all L x L pairs) over the tries' useful FLOPs (each shared token once, each token
attending its own sequence). Training: `bench.grpo`'s ideal. Whole step: TRL's measured phase times each divided by
its phase's ideal (what the step would take if every phase reached its ideal). `decode_cascade` is what decoding
reaches by bytes read where each prompt's keys and values are read once per group per step (prefixdpo's decoding
over prompts held once): weights + U x P + N x t cached tokens read instead of weights + N x (P + t).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from prefixdpo_tools.bench.flops import FlopCount, ModelShape, forward_flops
from prefixdpo_tools.bench.grpo import GroupProfileResult, Rollout, _sync
from prefixdpo_tools.bench.memory import PeakMemory
from prefixdpo.core.verify import stock_attention
from prefixdpo.grpo.generation import SharedPromptRoute, generate_routed, group_prompt_rows
from prefixdpo.grpo.reward_models import group_examples, shared_reward_scores

PHASES = ("generation", "scoring", "training")


# ---------------------------------------------------------------------------------------------- inputs


def reward_rows(rollout: Rollout, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """TRL's reward-model rows of a rollout: each row's real prompt tokens then its real completion tokens,
    right-padded -> (input_ids [N, L], attention_mask [N, L], the prompt group of each row)."""
    rows = [torch.cat([p[pm.bool()], c[cm.bool()]]) for p, pm, c, cm in
            zip(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    groups = group_prompt_rows(rollout.prompt_ids, rollout.prompt_mask).row_to_unique.tolist()
    return ids, mask, groups


# ---------------------------------------------------------------------------------------------- FLOP model


def generation_flops(shape: ModelShape, rows: int, unique: int, prompt_width: int, new_tokens: int,
                     *, shared: bool) -> tuple[FlopCount, FlopCount]:
    """(prefill, decode) forward FLOPs of generating `new_tokens` after `rows` left-padded prompts of width P, as
    run (padded slots included; one head position per row and step). Shared: `unique` prompts prefill P - 1
    columns, then every row's last column is a one-token step inside generate (the prefill part here)."""
    N, U, P, K = rows, unique, prompt_width, new_tokens
    if shared:
        prefill = forward_flops(shape, U * (P - 1), U * (P - 1) ** 2, U) + forward_flops(shape, N, N * P, N)
    else:
        prefill = forward_flops(shape, N * P, N * P * P, N)
    decode = FlopCount(0, 0, 0)
    for t in range(1, K):  # token t + 1 from a step over P + t keys
        decode = decode + forward_flops(shape, N, N * (P + t), N)
    return prefill, decode


def decode_cascade_ideal(shape: ModelShape, rows: int, unique: int, prompt_width: int, new_tokens: int,
                         bytes_per_value: int) -> float:
    """Bytes a decode step reads (weights + cached keys and values), summed over the steps: TRL's (every row its
    own prompt cache) over a cascade's (each prompt's cache once per group)."""
    N, U, P = rows, unique, prompt_width
    weights = (shape.body_params_per_token() + shape.lm_head_params()) * bytes_per_value
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * bytes_per_value
    trl = sum(weights + per_token * N * (P + t) for t in range(1, new_tokens))
    cascade = sum(weights + per_token * (U * P + N * t) for t in range(1, new_tokens))
    return trl / cascade if cascade else 1.0


def scoring_flops(shape: ModelShape, ids: torch.Tensor, mask: torch.Tensor, groups: list[int],
                  *, shared: bool) -> FlopCount:
    """Body + attention FLOPs of scoring the rows (the score head, hidden x 1, not counted): TRL's N x L padded rows
    with all L x L pairs, or the useful FLOPs of the groups' tries (each shared token once; a token at depth d
    attends d + 1 tokens)."""
    if not shared:
        N, L = ids.shape
        return forward_flops(shape, N * L, N * L * L, 0)
    from prefixdpo.data.tree import tree_line

    examples, _ = group_examples(ids, mask, groups)
    line = tree_line(examples)
    return forward_flops(shape, len(line), sum(d + 1 for d in line.position_ids), 0)


# ---------------------------------------------------------------------------------------------- timing


@dataclass
class PhaseTime:
    """Seconds per step of one phase: TRL's and prefixdpo's (medians over the counted passes), and their ratio."""

    trl: float
    ours: float
    speedup: float = field(init=False)  # trl / ours; a field, so that the report's JSON holds it with the times

    def __post_init__(self) -> None:
        self.speedup = self.trl / self.ours if self.ours else 0.0


@dataclass
class WholeStep:
    """The whole step of one profile (module doc). ideals: per phase (and prefill, decode_cascade, whole_step);
    peak_mb: generation's extra peak memory (TRL, prefixdpo); same_tokens: share of rows whose sampled completion
    equals TRL's for the same seed (fp32 rounding can flip a token only at a near-tie between two tokens)."""

    profile: str
    rows: int
    unique_prompts: int
    prompt_width: int
    new_tokens: int
    phases: dict[str, PhaseTime]
    prefill: PhaseTime
    ideals: dict[str, float]
    peak_mb: dict[str, float]
    same_tokens: float
    notes: list[str] = field(default_factory=list)

    def seconds(self, side: str) -> float:
        return sum(getattr(p, side) for p in self.phases.values())

    def share(self, phase: str, side: str) -> float:
        return getattr(self.phases[phase], side) / self.seconds(side)

    @property
    def speedup(self) -> float:
        return self.seconds("trl") / self.seconds("ours")

    @property
    def achieved_over_ideal(self) -> float:
        return self.speedup / self.ideals["whole_step"]


def _generate(model, rollout: Rollout, config, *, shared: bool, seed: int):
    """TRL's generate call on the model's stock attention, or the trainer's: routed, on prefixdpo's attention (the
    policy's), which decodes over prompts held once (`core.attention.shared_prompt`)."""
    torch.manual_seed(seed)
    kwargs = dict(input_ids=rollout.prompt_ids, attention_mask=rollout.prompt_mask, generation_config=config)
    if not shared:
        with stock_attention(model):
            return model.generate(**kwargs)
    notes: list[str] = []
    with generate_routed(model, SharedPromptRoute(notes.append)):
        out = model.generate(**kwargs)
    if notes:
        raise RuntimeError(f"shared-prompt generation fell back: {notes[0]}")
    return out


def _score(reward_model, inputs, *, shared: bool, backend: str):
    ids, mask, groups = inputs
    if not shared:
        with stock_attention(reward_model):
            return reward_model(input_ids=ids, attention_mask=mask).logits[:, 0]
    return shared_reward_scores(reward_model, ids, mask, groups, backend=backend)


@dataclass
class _CallTimes:
    """What `time_whole_step`'s interleaved calls measured: seconds per (phase, side) per counted pass, generation's
    peak bytes per side, and how many generated rows were the same on both sides (first pass)."""

    repeats: int
    seconds: dict = field(default_factory=dict)
    peak: dict = field(default_factory=lambda: {"trl": 0, "ours": 0})
    equal_rows: int = 0
    total_rows: int = 0

    def __post_init__(self):
        self.seconds = {(phase, side): [0.0] * self.repeats for phase in ("prefill", "generation", "scoring")
                        for side in ("trl", "ours")}


def _time_rollout(times: _CallTimes, calls: dict, meter, dev, clock, r: int, warmup: int, progress) -> dict:
    """One pass over one rollout: each phase's call on each side (`calls[(phase, side)]`), timed; in the first pass
    generation's peak memory too. -> each side's generated ids in the first pass (else {})."""
    outs = {}
    for side in ("trl", "ours"):
        for phase in ("prefill", "generation", "scoring"):
            first_generation = r == 0 and phase == "generation"
            with meter if first_generation else contextlib.nullcontext():
                _sync(dev)
                t0 = clock()
                out = calls[(phase, side)]()
                _sync(dev)
                dt = clock() - t0
            if first_generation:
                times.peak[side] = max(times.peak[side], meter.peak_bytes)
                outs[side] = out
            if r >= warmup:
                times.seconds[(phase, side)][r - warmup] += dt
            if progress is not None:
                progress.update(1)
    return outs


def time_whole_step(trainer, reward_model, result: GroupProfileResult, rollouts: list[Rollout], shape: ModelShape, *,
                    device: str, backend: str, repeats: int, warmup: int, pad_id: int,
                    clock: Callable[[], float] = time.perf_counter, progress=None) -> WholeStep:
    """Generation and scoring of every rollout, TRL's and prefixdpo's interleaved call by call (`warmup` uncounted
    passes, then `repeats`), beside the training part `result` measured; the prefill alone timed the same way
    (generate with one new token). Peak memory and the token check in the first pass."""
    dev = torch.device(device)
    batches = [r.to(dev) for r in rollouts]
    scoring_inputs = [tuple(t.to(dev) if torch.is_tensor(t) else t for t in reward_rows(r, pad_id)) for r in rollouts]
    model = trainer.model
    K = rollouts[0].logits_to_keep
    config = copy.deepcopy(trainer.generation_config)
    config.max_new_tokens = config.min_new_tokens = K
    first_token = copy.deepcopy(config)
    first_token.max_new_tokens = first_token.min_new_tokens = 1
    times, meter = _CallTimes(repeats), PeakMemory(dev)
    was_training = model.training
    model.eval()  # no dropout: the bench's Llama has none, and generation must not draw for it
    reward_model.eval()
    try:
        with torch.inference_mode():
            for r in range(warmup + repeats):
                for i, rollout in enumerate(batches):
                    calls = {}
                    for side, shared in (("trl", False), ("ours", True)):
                        calls[("prefill", side)] = functools.partial(_generate, model, rollout, first_token,
                                                                     shared=shared, seed=r)
                        calls[("generation", side)] = functools.partial(_generate, model, rollout, config,
                                                                        shared=shared, seed=r)
                        calls[("scoring", side)] = functools.partial(_score, reward_model, scoring_inputs[i],
                                                                     shared=shared, backend=backend)
                    outs = _time_rollout(times, calls, meter, dev, clock, r, warmup, progress)
                    if r == 0:
                        times.equal_rows += int((outs["trl"] == outs["ours"]).all(dim=1).sum())
                        times.total_rows += outs["trl"].shape[0]
                        if outs["trl"].shape[1] != rollout.prompt_ids.shape[1] + K:
                            raise RuntimeError("generate did not make exactly the rollout's K new tokens")
    finally:
        model.train(was_training)
    return _whole_step(times, result, rollouts, scoring_inputs, shape, model, meter.method)


def _whole_step(times: _CallTimes, result: GroupProfileResult, rollouts: list[Rollout], scoring_inputs, shape,
                model, memory_method: str) -> WholeStep:
    """The `WholeStep` of what `time_whole_step` measured (medians per step) and the training part `result` timed."""

    def per_step(phase: str, side: str) -> float:
        return statistics.median(times.seconds[(phase, side)]) / len(rollouts)

    phases = {p: PhaseTime(per_step(p, "trl"), per_step(p, "ours")) for p in ("generation", "scoring")}
    phases["training"] = PhaseTime(result.modes["trl"].seconds_per_step, result.modes["shared-packed"].seconds_per_step)
    prefill = PhaseTime(per_step("prefill", "trl"), per_step("prefill", "ours"))
    ideals = _ideals(shape, rollouts, scoring_inputs, phases, prefill, result, bytes_per_value=_bytes(model))
    U = statistics.median(group_prompt_rows(r.prompt_ids, r.prompt_mask).num_unique for r in rollouts)
    return WholeStep(profile=result.name, rows=rollouts[0].num_rows, unique_prompts=int(U),
                     prompt_width=int(statistics.median(r.prompt_ids.shape[1] for r in rollouts)),
                     new_tokens=rollouts[0].logits_to_keep, phases=phases, prefill=prefill, ideals=ideals,
                     peak_mb={s: v / 2**20 for s, v in times.peak.items()},
                     same_tokens=times.equal_rows / times.total_rows,
                     notes=[f"generation peak memory: {memory_method}, first pass"])


def _bytes(model) -> int:
    return next(model.parameters()).element_size()


def _ideals(shape: ModelShape, rollouts: list[Rollout], scoring_inputs, phases: dict[str, PhaseTime],
            prefill: PhaseTime, result: GroupProfileResult, *, bytes_per_value: int) -> dict[str, float]:
    """Per-phase ideals and the whole step's (module doc)."""
    pre = {True: 0, False: 0}
    cascade = []
    for r in rollouts:
        N, P, K = r.num_rows, r.prompt_ids.shape[1], r.logits_to_keep
        U = group_prompt_rows(r.prompt_ids, r.prompt_mask).num_unique
        for shared in (True, False):
            pre[shared] += generation_flops(shape, N, U, P, K, shared=shared)[0].total
        cascade.append(decode_cascade_ideal(shape, N, U, P, K, bytes_per_value))
    score = {s: sum(scoring_flops(shape, *inputs, shared=s).total for inputs in scoring_inputs) for s in (True, False)}
    prefill_ideal = pre[False] / pre[True]
    g = phases["generation"].trl
    decode_s = max(g - prefill.trl, 0.0)
    ideals = {"prefill": prefill_ideal,
              "generation": g / (min(prefill.trl, g) / prefill_ideal + decode_s) if g else 1.0,
              "scoring": score[False] / score[True], "training": result.ideal.vs_trl_rows,
              "decode_cascade": statistics.mean(cascade)}
    ideal_seconds = sum(phases[p].trl / ideals[p] for p in PHASES)
    ideals["whole_step"] = sum(phases[p].trl for p in PHASES) / ideal_seconds
    return ideals
