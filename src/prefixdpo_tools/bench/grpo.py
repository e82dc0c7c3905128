"""`prefixdpo bench --task grpo`: the training part of a GRPO step in TRL's layout and prefix-shared, on the same
rollouts, interleaved.

What one step is (TRL 1.16's code for everything but the layout of the log-prob passes): for one rollout of B
prompts x G completions, the old-policy pass when `num_iterations > 1` and the reference pass when `beta > 0`
(no grad, as `_generate_and_score_completions` runs them), then `num_iterations` times TRL's `_compute_loss` (the
policy pass with grad, the loss) + backward + AdamW. Three modes run it on one `PrefixGRPOTrainer`, one model and
one optimizer, differing only in how its passes lay out the rows:

    trl            TRL's own pass: B x G rows ``[left-padded prompt][right-padded completion]``, the model's stock
                   SDPA attention, TRL's fused LM head (prefix sharing off);
    shared         prefix-shared: each prompt once, its G completions as branches after it, one line per prompt;
    shared-packed  the same lines packed across prompts.

Rollouts are synthetic and seeded (`synthetic_rollouts`): each profile's prompts start with one system prompt, the
completions' lengths are spread over the profile's range, some end at EOS and some are cut at the maximum
completion length, and the rows are shuffled (as TRL shuffles them between generation and training).

The FLOP model's ideal (`flops.py`'s counts): TRL's rows as TRL runs them (every slot, padding included, through the
body; all L x L query-key pairs, as SDPA with a padding mask computes them; the LM head where TRL's fused head
scores: every position without Triton, the completion tokens with it) over the useful FLOPs of the prefix-shared
lines (real tokens; allowed query-key pairs; the head at completion tokens). "sharing alone" is the same ratio with
TRL's rows counted by their real tokens only: what computing each prompt once saves, padding aside.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from prefixdpo_tools.bench.flops import FlopCount, ModelShape, forward_flops, shared_flop_count, standard_flop_count

from prefixdpo_tools.bench.memory import PeakMemory

from prefixdpo_tools.bench.results import ModeRun, WorkloadRun
from prefixdpo_tools.bench.spread import Spread

from prefixdpo.errors import UserError

from prefixdpo.core.verify import stock_attention

MODES = ("trl", "shared", "shared-packed")
ONE_LINE = 1 << 40  # a pack length every step's groups fit in


@dataclass(frozen=True)
class GroupProfile:
    """The lengths of one benchmark profile, in tokens at scale 1.

    group_size: G, completions per prompt; prompts_per_step: B; system_tokens: the system prompt every prompt
    starts with; prompt_tokens / completion_tokens: (shortest, longest) length, drawn uniformly; the longest
    completion length is the maximum completion length, where `cut_share` of the completions are cut (no EOS).
    """

    name: str
    group_size: int
    prompts_per_step: int
    system_tokens: int
    prompt_tokens: tuple[int, int]
    completion_tokens: tuple[int, int]
    cut_share: float = 0.2

    def scaled(self, scale: float) -> GroupProfile:
        """Every length times `scale` (at least 1 token; G, B and the cut share unchanged)."""
        if not scale > 0:
            raise UserError(f"length scale must be positive, got {scale}")

        def s(n: int) -> int:
            return max(1, round(n * scale))

        return replace(self, system_tokens=s(self.system_tokens),
                       prompt_tokens=(s(self.prompt_tokens[0]), s(self.prompt_tokens[1])),
                       completion_tokens=(s(self.completion_tokens[0]), s(self.completion_tokens[1])))


PROFILES = {
    p.name: p for p in (
        # math / reasoning RL: a system prompt + a problem, long chains of thought
        GroupProfile("math-like", 8, 2, 120, (150, 300), (300, 800)),
        # long context: a document or a dialogue history, short answers
        GroupProfile("long-context", 8, 2, 120, (2000, 4000), (200, 400), cut_share=0.1),
        # the math-like lengths with twice the completions per prompt
        GroupProfile("math-like-g16", 16, 1, 120, (150, 300), (300, 800)),
    )
}


@dataclass
class Rollout:
    """One micro-batch of TRL's rows (N = B x G, shuffled) and the lengths the FLOP model needs.

    prompt_ids, prompt_mask: [N, P] left-padded; completion_ids, completion_mask: [N, K] right-padded (the mask
    covers the completion up to and including its EOS); advantages: [N] fp32.
    groups: (prompt length, [completion lengths]) per prompt.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    groups: list[tuple[int, list[int]]]

    @property
    def num_rows(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def logits_to_keep(self) -> int:
        return int(self.completion_ids.shape[1])

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """TRL's (input_ids, attention_mask) [N, P + K], as its passes receive them."""
        return (torch.cat([self.prompt_ids, self.completion_ids], 1),
                torch.cat([self.prompt_mask, self.completion_mask], 1))

    def loss_inputs(self) -> dict:
        """The inputs TRL's `_compute_loss` reads (dapo's `num_items_in_batch`: the completion tokens)."""
        return {"prompt_ids": self.prompt_ids, "prompt_mask": self.prompt_mask, "completion_ids": self.completion_ids,
                "completion_mask": self.completion_mask, "advantages": self.advantages,
                "num_items_in_batch": self.completion_mask.sum().float()}

    def to(self, device) -> Rollout:
        move = {k: getattr(self, k).to(device) for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                         "completion_mask", "advantages")}
        return replace(self, **move)


def synthetic_rollout(profile: GroupProfile, *, vocab_size: int, rng: random.Random, eos_id: int,
                      pad_id: int) -> Rollout:
    """B prompts x G completions of `profile`'s lengths (see `GroupProfile`), token ids in [3, vocab) other than
    EOS (which only ends a completion)."""
    def ids(n: int) -> list[int]:
        out = [rng.randrange(3, vocab_size) for _ in range(n)]
        return [t if t != eos_id else 3 if eos_id != 3 else 4 for t in out]

    system = ids(profile.system_tokens)
    K = profile.completion_tokens[1]
    prompts, completions = [], []
    for _ in range(profile.prompts_per_step):
        length = max(rng.randint(*profile.prompt_tokens), len(system) + 1)
        prompts.append(system + ids(length - len(system)))
        group = []
        for g in range(profile.group_size):
            cut = g == 0 or rng.random() < profile.cut_share  # one cut per group: generation runs to the limit
            group.append(ids(K) if cut else ids(rng.randint(profile.completion_tokens[0], K) - 1) + [eos_id])
        completions.append(group)
    P = max(len(p) for p in prompts)
    rows = [(p, c) for p, group in zip(prompts, completions) for c in group]
    rng.shuffle(rows)
    pid = torch.tensor([[pad_id] * (P - len(p)) + p for p, _ in rows])
    pmask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p, _ in rows])
    cid = torch.tensor([c + [pad_id] * (K - len(c)) for _, c in rows])
    cmask = torch.tensor([[1] * len(c) + [0] * (K - len(c)) for _, c in rows])
    advantages = torch.tensor([rng.gauss(0.0, 1.0) for _ in rows])
    groups = [(len(p), [len(c) for c in group]) for p, group in zip(prompts, completions)]
    return Rollout(pid, pmask, cid, cmask, advantages, groups)


def synthetic_rollouts(profile: GroupProfile, steps: int, *, vocab_size: int, seed: int = 0, eos_id: int = 2,
                       pad_id: int = 0) -> list[Rollout]:
    """`steps` seeded rollouts of `profile` (one per optimizer step); the default special tokens are the
    benchmark model's (`bench.model.llama_config`)."""
    rng = random.Random(f"{profile.name}:{seed}")
    return [synthetic_rollout(profile, vocab_size=vocab_size, rng=rng, eos_id=eos_id, pad_id=pad_id)
            for _ in range(steps)]


# ---------------------------------------------------------------------------------------------- FLOP model


def trl_rows_flops(shape: ModelShape, rollout: Rollout, *, head_every_position: bool) -> FlopCount:
    """Forward FLOPs of TRL's N x L rows as its pass runs them: body on every slot (padding included), all L x L
    query-key pairs (SDPA with a padding mask), the LM head at every shifted position (`head_every_position`: TRL's
    fused head without Triton) or at the completion tokens only (with Triton)."""
    N, L = rollout.num_rows, rollout.prompt_ids.shape[1] + rollout.logits_to_keep
    head = N * (L - 1) if head_every_position else int(rollout.completion_mask.sum())
    return forward_flops(shape, N * L, N * L * L, head)


def useful_flops(shape: ModelShape, rollout: Rollout, *, shared: bool) -> FlopCount:
    """Useful forward FLOPs (real tokens, allowed pairs, head at completion tokens) of the prefix-shared lines
    (`shared`) or of TRL's rows without their padding."""
    count = shared_flop_count if shared else standard_flop_count
    total = FlopCount(0, 0, 0)
    for group in rollout.groups:
        total = total + count(shape, group)
    return total


@dataclass
class Ideal:
    """FLOP ratios of one workload (see the module doc). split_*: shares of body / attention / head."""

    vs_trl_rows: float
    sharing_alone: float
    split_trl: dict
    split_shared: dict


def ideal_speedups(shape: ModelShape, rollouts: list[Rollout], *, head_every_position: bool) -> Ideal:
    def total(fn, **kw) -> FlopCount:
        out = FlopCount(0, 0, 0)
        for r in rollouts:
            out = out + fn(shape, r, **kw)
        return out

    trl = total(trl_rows_flops, head_every_position=head_every_position)
    standard, shared = total(useful_flops, shared=False), total(useful_flops, shared=True)

    def split(c: FlopCount) -> dict:
        return {"body": c.body / c.total, "attention": c.attention / c.total, "lm_head": c.lm_head / c.total}

    return Ideal(trl.total / shared.total, standard.total / shared.total, split(trl), split(shared))


# ---------------------------------------------------------------------------------------------- the step


def build_bench_trainer(model_dir: str, tokenizer, *, backend: str, dtype: torch.dtype, device: str, beta: float,
                        num_iterations: int, group_size: int, output_dir: str):
    """A `PrefixGRPOTrainer` over the saved model (TRL loads the policy and, when beta > 0, its reference from the
    path, as for a user's checkpoint); TRL's defaults (dapo, temperature 1) but no gradient checkpointing and no
    autocast (the weights are in `dtype`)."""
    from datasets import Dataset

    from prefixdpo.grpo.config import PrefixGRPOConfig
    from prefixdpo.grpo.trainer import PrefixGRPOTrainer
    from prefixdpo.grpo.verify import zero_reward

    args = PrefixGRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=group_size, num_generations=group_size, beta=beta,
        num_iterations=num_iterations, use_cpu=not device.startswith("cuda"), bf16=False, report_to="none",
        save_strategy="no", gradient_checkpointing=False, attention=backend, disable_tqdm=True,
        model_init_kwargs={"dtype": dtype})
    return PrefixGRPOTrainer(model=model_dir, reward_funcs=zero_reward, args=args,
                             train_dataset=Dataset.from_dict({"prompt": ["a"] * group_size}),
                             processing_class=tokenizer)


class GroupTrainingStep:
    """`run(rollout, mode)`: the training part of one GRPO step (see the module doc) in `mode`.

    line_per_step: shared-packed puts all of a step's groups in one line (an attention that computes only allowed
    blocks, segmented, pays nothing for the longer line); else the trainer's `pack_length` ('auto') packs them.

    One AdamW (fused where the device has it, as the DPO bench's step) over the trainer's policy, shared by every
    mode: the weights' values do not change a step's cost, so the modes run literally the same modules.
    """

    def __init__(self, trainer, *, lr: float = 1e-6, line_per_step: bool = False):
        self.trainer = trainer
        self.line_per_step = line_per_step
        self.num_iterations = trainer.args.num_iterations
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        try:
            self.optimizer = torch.optim.AdamW(params, lr=lr, fused=True)
        except (RuntimeError, ValueError):
            self.optimizer = torch.optim.AdamW(params, lr=lr)
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, read by TRL's loss normalisers
        trainer.model.train()

    @contextlib.contextmanager
    def mode(self, mode: str):
        """The trainer's passes laid out as `mode` says (its options restored after)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        trainer = self.trainer
        saved = trainer.group_settings
        trainer.change_settings(prefix_sharing=mode != "trl", packing=mode == "shared-packed",
                                pack_length=ONE_LINE if self.line_per_step else saved.pack_length)
        models = [m for m in (self.trainer.model, self.trainer.ref_model) if m is not None]
        try:
            with contextlib.ExitStack() as stack:
                if mode == "trl":  # TRL's pass on the model's stock attention, as TRL runs it
                    for m in models:
                        stack.enter_context(stock_attention(m))
                yield
        finally:  # through change_settings, as every change: the run's sharing follows the settings
            trainer.change_settings(prefix_sharing=saved.prefix_sharing, packing=saved.packing,
                                    pack_length=saved.pack_length)

    def run(self, rollout: Rollout, mode: str) -> float:
        """One step; returns the mean completion-token entropy TRL's loss logged in its first iteration (a
        number of the pass itself: modes on the same weights must agree on it)."""
        trainer, model = self.trainer, self.trainer.model
        inputs = rollout.loss_inputs()
        input_ids, attention_mask = rollout.rows()
        K, N = rollout.logits_to_keep, rollout.num_rows
        with self.mode(mode):
            with torch.no_grad():  # TRL's `_generate_and_score_completions` passes (batch_size = the micro-batch)
                if self.num_iterations > 1:
                    inputs["old_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                        model, input_ids, attention_mask, K, N)[0]
                if trainer.beta != 0.0:
                    inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                        trainer.ref_model, input_ids, attention_mask, K, N)[0]
            for _ in range(self.num_iterations):
                loss = trainer._compute_loss(model, inputs)
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        entropy = trainer._metrics["train"]["entropy"][0]
        trainer._metrics["train"].clear()  # TRL's metric lists would grow with every step
        return entropy


# ---------------------------------------------------------------------------------------------- runner


@dataclass
class GroupModeResult(ModeRun):
    """One mode on one profile: `ModeRun`'s fields (tokens: the real tokens its passes run per pass), completions
    per second of each counted pass, and TRL's logged mean entropy of each step in the first (warm-up) pass."""

    completions_per_s: Spread
    entropies: list[float]


@dataclass(kw_only=True)
class GroupProfileResult(WorkloadRun):
    """All modes on one profile (`WorkloadRun`; speedups over TRL's layout), its sizes and the FLOP model's ideal."""

    group_size: int
    prompts_per_step: int
    lengths: dict
    ideal: Ideal

    @property
    def achieved_over_ideal(self) -> float:
        return self.speedups["shared_packed_vs_trl"].median / self.ideal.vs_trl_rows


def layout_stats(rollout: Rollout, mode: str, *, bucket: bool, pack_length) -> tuple[int, int, int]:
    """(real tokens, slots, lines) of one pass over `rollout` in `mode` (the trainer's own layout function)."""
    from prefixdpo.grpo.layout import layout_groups

    input_ids, attention_mask = rollout.rows()
    if mode == "trl":
        return int(attention_mask.sum()), attention_mask.numel(), rollout.num_rows
    lines = layout_groups(input_ids, attention_mask, rollout.logits_to_keep, packing=mode == "shared-packed",
                          pack_length=pack_length, bucket=bucket)
    return lines.num_real_tokens, lines.num_slots, lines.num_lines


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_profile(profile: GroupProfile, rollouts: list[Rollout], step: GroupTrainingStep, shape: ModelShape, *,
                device: str, repeats: int, warmup: int, progress=None,
                clock: Callable[[], float] = time.perf_counter) -> GroupProfileResult:
    """Every mode on every rollout, interleaved step by step (A B C, A B C, ...), `warmup` uncounted passes then
    `repeats` counted ones; speedups are per-pass time ratios (both modes saw the same moment of the machine).

    Peak memory is measured in the first pass only (the warm-up one where there is one): on CPU the meter returns
    freed heap to the system before each step (`PeakMemory`), which makes the next step fault its pages in again,
    a cost a training loop does not pay; the counted passes run without it. `clock`: what a step's seconds are read
    from (`bench.clock`: wall or this process's CPU time)."""
    from trl.kernels.chunked_logprob import _use_triton

    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    dev = torch.device(device)
    batches = [r.to(dev) for r in rollouts]
    bucket = step.trainer.group_settings.attention in ("flex", "varlen")
    seconds = {m: [0.0] * repeats for m in MODES}
    entropies: dict[str, list[float]] = {m: [] for m in MODES}
    peak = dict.fromkeys(MODES, 0)
    meter = PeakMemory(dev)
    for r in range(warmup + repeats):
        for rollout in batches:
            for mode in MODES:
                with meter if r == 0 else contextlib.nullcontext():
                    _sync(dev)
                    t0 = clock()
                    entropy = step.run(rollout, mode)
                    _sync(dev)
                    dt = clock() - t0
                if r >= warmup:
                    seconds[mode][r - warmup] += dt
                if r == 0:
                    peak[mode] = max(peak[mode], meter.peak_bytes)
                    entropies[mode].append(entropy)
                if progress is not None:
                    progress.update(1)
    completions = sum(r.num_rows for r in rollouts)
    modes = {}
    for mode in MODES:
        pack_length = ONE_LINE if step.line_per_step else step.trainer.group_settings.pack_length
        stats = [layout_stats(r, mode, bucket=bucket, pack_length=pack_length) for r in rollouts]
        modes[mode] = GroupModeResult(
            mode=mode, completions_per_s=Spread.of([completions / s for s in seconds[mode]]), seconds=seconds[mode],
            peak_mb=peak[mode] / 2**20, tokens=sum(s[0] for s in stats), slots=sum(s[1] for s in stats),
            lines=sum(s[2] for s in stats), entropies=entropies[mode], steps=len(rollouts))
    speedups = {f"{fast.replace('-', '_')}_vs_trl": Spread.of([b / a for a, b in zip(seconds[fast], seconds["trl"])])
                for fast in ("shared", "shared-packed")}
    ideal = ideal_speedups(shape, rollouts, head_every_position=not _use_triton(dev))
    return GroupProfileResult(
        name=profile.name, group_size=profile.group_size, prompts_per_step=profile.prompts_per_step,
        steps=len(rollouts), lengths=_length_summary(profile, rollouts), ideal=ideal, modes=modes, speedups=speedups,
        notes=[f"peak memory: {meter.method}, in the first pass"])


def _length_summary(profile: GroupProfile, rollouts: list[Rollout]) -> dict:
    prompts = [p for r in rollouts for p, _ in r.groups]
    completions = [c for r in rollouts for _, cs in r.groups for c in cs]
    cut = sum(c == profile.completion_tokens[1] for c in completions)
    return {"system_prompt": profile.system_tokens, "prompt_median": statistics.median(prompts),
            "prompt_range": [min(prompts), max(prompts)], "completion_median": statistics.median(completions),
            "completion_range": [min(completions), max(completions)],
            "max_completion_length": profile.completion_tokens[1], "cut_share": cut / len(completions)}
