"""`prefixdpo bench --task reuse`: a long prompt with K responses, beyond a per-pass budget, three ways.

The long-prompt profile: K = 8 responses after each prompt, pairs (0, 1), (2, 3), ... Full: prompts of 8-16k
tokens, responses of 0.5-2k; `--quick`: an eighth of that (1-2k, 64-256). The budget of one pass (reused) is
its two longest responses, so a chunk holds a pair (a row of the split mode: the prompt and a pair). A DPO step of each
example (the policy's pass with gradient, the reference's without, the sigmoid loss of its pairs, backward), in
three modes, interleaved example by example:

- one-row:   the prompt and all 8 responses in one row (what fits where memory allows it);
- split:     today's way around the budget: one row per pair, each `[prompt][pair's two responses]`, the prompt
             computed again for every pair (4 x here), gradients accumulated;
- reused:    prefix reuse (`core.prefix_reuse`): the prompt once, the pairs as chunks against its K/V.

Every mode computes the same loss and gradients (the gradient norm of each mode's first step is reported beside).
Reported per mode: seconds per example (median); the activations the policy's forward keeps for backward (every
tensor autograd saved, counted once by storage, the weights left out: `SavedActivations`; in the split mode the
largest of its rows, one alive at a time); the peak memory of the whole step (`bench.memory.PeakMemory`: with
everything else a step allocates); and the ratios to one-row. The activations of prefix reuse are compared with
what the prompt and one chunk keep: one-row's per token x (prompt + the longest chunk's tokens).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from prefixdpo.atomic_io import atomic_write_text
from prefixdpo.data.example import Example

MODES = ("one-row", "split", "reused")
K = 8


class SavedActivations:
    """`with meter:` around a forward with gradient: `meter.bytes`, what autograd saved for backward (each storage
    once, `model`'s parameters left out). Tensors an activation checkpoint recomputes are not saved, so not counted
    (its own hooks are the innermost)."""

    def __init__(self, model):
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.weights:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


@dataclass
class ReuseResult:
    """Per mode: seconds per example, peak bytes of the step and activation bytes of the policy's forward, over the
    examples; the grad norm each mode's first step gave; the tokens of the prompt and longest chunk vs the row."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    peak: dict[str, list[int]] = field(default_factory=lambda: {m: [] for m in MODES})
    activations: dict[str, list[int]] = field(default_factory=lambda: {m: [] for m in MODES})
    grad_norms: dict[str, float] = field(default_factory=dict)
    reused_tokens: list[float] = field(default_factory=list)  # (prompt + longest chunk) / row, per example


def long_prompt_examples(n: int, scale: float, vocab: int, seed: int = 0) -> list[Example]:
    """`n` examples: a prompt of 8k-16k x scale tokens and K responses of 512-2048 x scale, pairs (0, 1), (2, 3)..."""
    g = random.Random(seed)

    def ids(lo: int, hi: int) -> tuple[int, ...]:
        return tuple(g.randrange(3, vocab) for _ in range(g.randrange(max(1, int(lo * scale)), int(hi * scale) + 1)))

    return [Example(ids(8192, 16384), tuple(ids(512, 2048) for _ in range(K)),
                    tuple((i, i + 1) for i in range(0, K, 2)), source_index=e) for e in range(n)]


def pair_examples(example: Example) -> list[Example]:
    """`example` split as today's way around a budget does: one example per pair, the prompt in each."""
    return [Example(example.prompt_ids, (example.response_ids[i], example.response_ids[j]), ((0, 1),))
            for i, j in example.pairs]


def budget_of(example: Example) -> int:
    """Prefix reuse's budget for `example`: its two longest responses, so that a chunk holds one pair, as a row of
    the split mode does (the prefix's own pass is longer: it must run whole)."""
    longest = sorted((len(r) for r in example.response_ids), reverse=True)
    return longest[0] + longest[1]


def _dpo_step(policy, reference, batch, mask, beta: float = 0.1) -> int:
    """The sigmoid DPO loss of `batch`'s pairs, summed (not averaged: the modes' gradients add up the same), backward;
    -> the activation bytes the policy's forward kept (`SavedActivations`)."""
    from prefixdpo.core.forward import compute_response_logps

    with torch.no_grad():
        ref = compute_response_logps(reference, batch, mask).sums
    with SavedActivations(policy) as saved:
        pol = compute_response_logps(policy, batch, mask).sums
    b, w = batch.pair_better, batch.pair_worse
    margin = beta * ((pol[b] - ref[b]) - (pol[w] - ref[w]))
    (-torch.nn.functional.logsigmoid(margin)).sum().backward()
    return saved.bytes


def run_mode(mode: str, example: Example, policy, reference, backend: str, device: str) -> int:
    """One DPO step of `example` in `mode` (module docstring); -> activation bytes (the largest row's in split)."""
    from prefixdpo.core.attention.pass_plan import plan_pass
    from prefixdpo.data.batch import build_batch

    if mode == "split":
        kept = 0
        for part in pair_examples(example):
            batch = build_batch([part]).to(device)
            kept = max(kept, _dpo_step(policy, reference, batch, plan_pass(batch, backend)))
        return kept
    batch = build_batch([example]).to(device)
    budget = budget_of(example) if mode == "reused" else None
    return _dpo_step(policy, reference, batch, plan_pass(batch, backend, max_tokens_per_pass=budget))


def reused_share(example: Example) -> float:
    """(prompt + the longest chunk prefix reuse runs) / the row's tokens: one-row's activations scaled to what prefix
    reuse should keep at most."""
    from prefixdpo.core.attention.reuse_plan import plan_line
    from prefixdpo.data.batch import build_batch

    batch = build_batch([example])
    plan = plan_line(batch.spans[0], 0, budget_of(example))
    return (plan.prefix + max(end - start for start, end in plan.chunks)) / example.shared_length


def _grad_norm(model) -> float:
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))


def run_reuse_bench(policy, reference, examples: list[Example], *, backend: str, device: str, repeats: int,
                    clock, memory) -> ReuseResult:
    """Each example's step in every mode, interleaved, `repeats` times after one uncounted pass; the first pass's
    gradient norms per mode (the modes must agree). memory: a `PeakMemory` factory."""
    result = ReuseResult()
    for counted in [False] + [True] * repeats:
        for example in examples:
            for mode in MODES:
                policy.zero_grad(set_to_none=True)
                meter = memory()
                start = clock()
                with meter:
                    kept = run_mode(mode, example, policy, reference, backend, device)
                seconds = clock() - start
                if not counted and example is examples[0]:
                    result.grad_norms[mode] = _grad_norm(policy)
                if counted:
                    result.seconds[mode].append(seconds)
                    result.peak[mode].append(meter.peak_bytes)
                    result.activations[mode].append(kept)
    policy.zero_grad(set_to_none=True)
    result.reused_tokens = [reused_share(example) for example in examples]
    return result


def report(result: ReuseResult, examples: list[Example], meta: dict) -> str:
    """The markdown table of one run."""
    med = {m: statistics.median(result.seconds[m]) for m in MODES}
    peak = {m: max(result.peak[m]) for m in MODES}
    act = {m: max(result.activations[m]) for m in MODES}
    bound = max(share * a for share, a in zip(result.reused_tokens, result.activations["one-row"]))
    prompts = [len(ex.prompt_ids) for ex in examples]
    responses = [len(r) for ex in examples for r in ex.response_ids]
    lines = [
        "# prefixdpo bench --task reuse: a long prompt with 8 responses, over a per-pass budget",
        "",
        *(f"- {k}: {v}" for k, v in meta.items()),
        f"- examples: {len(examples)}; prompt tokens {min(prompts)}-{max(prompts)}, response tokens "
        f"{min(responses)}-{max(responses)}; budget per pass (reused): the two longest responses (a chunk holds a pair)",
        "",
        "| mode | s / example (median) | time vs one-row | activations (MiB) | vs one-row | peak memory of the step "
        "(MiB) | vs one-row | grad norm |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {m} | {med[m]:.3f} | {med[m] / med['one-row']:.2f} | {act[m] / 2**20:.1f} | "
          f"{act[m] / max(act['one-row'], 1):.2f} | {peak[m] / 2**20:.0f} | {peak[m] / max(peak['one-row'], 1):.2f} | "
          f"{result.grad_norms.get(m, float('nan')):.6g} |" for m in MODES),
        "",
        f"reused is {med['split'] / med['reused']:.2f}x faster than split (the prompt computed once instead of "
        f"{K // 2} times) and takes {med['reused'] / med['one-row']:.2f}x one-row's time (the responses of every "
        "chunk but the last are computed again in backward). Its activations, "
        f"{act['reused'] / 2**20:.1f} MiB, against {bound / 2**20:.1f} MiB for the prompt and one chunk (one-row's "
        "per token x their tokens).",
    ]
    return "\n".join(lines) + "\n"


def run(args, *, threads: int) -> int:
    """`prefixdpo bench --task reuse` (module docstring)."""
    from prefixdpo_tools.bench.clock import step_clock
    from prefixdpo_tools.bench.memory import PeakMemory
    from prefixdpo_tools.bench.model import SHAPES, build_models

    torch.set_num_threads(threads)
    clock = step_clock(args.clock, args.device)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = args.attention if args.attention != "auto" else ("flex" if cuda else "segmented")
    shape = SHAPES[args.model_size or ("quick" if args.quick else "default")]
    policy, reference, shape = build_models(args.model or shape, device=args.device, dtype=dtype, backend=backend,
                                            seed=args.seed, trust_remote_code=args.trust_remote_code)
    scale = args.length_scale or (0.125 if args.quick else 1.0)
    examples = long_prompt_examples(args.examples or 2, scale, shape.vocab, args.seed)
    t0 = time.perf_counter()
    result = run_reuse_bench(policy, reference, examples, backend=backend, device=args.device,
                             repeats=args.repeats or (2 if args.quick else 3), clock=clock,
                             memory=lambda: PeakMemory(args.device))
    meta = {"device": f"{args.device}, {dtype}, {torch.get_num_threads()} threads, attention '{backend}'",
            "model": args.model or f"random Llama-shaped: hidden {shape.hidden}, {shape.layers} layers",
            "memory": PeakMemory(args.device).method,
            "timing": f"{time.perf_counter() - t0:.0f} s; {args.clock} clock; torch {torch.__version__}"}
    md = report(result, examples, meta)
    from pathlib import Path

    out = Path(args.out)
    atomic_write_text(str(out / "bench-reuse.md"), md)
    print(md)
    return 0
