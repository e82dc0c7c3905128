"""`prefixdpo bench`: standard DPO vs prefix sharing, with and without packing, side by side with the paper.

    prefixdpo bench [--quick] [--profiles a,b] [--device cpu|cuda] [--model PATH] [--dataset D --tokenizer T]
                    [--examples N] [--per-step N] [--repeats N] [--warmup N] [--length-scale F] [--out DIR]

Writes DIR/bench.md (tables), DIR/bench.json (every number) and DIR/bench.png (chart), and prints the
markdown. Defaults (CPU, fp32): the six synthetic profiles at half the paper's lengths on a 4-layer
Llama-shaped model (about 10 minutes on 2 cores); `--quick`: quarter lengths, 2 layers (about a
minute). CUDA: bf16, compiled FlexAttention, the paper's lengths and an 8-layer model unless given.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

from prefixdpo.atomic_io import atomic_write_text
from prefixdpo.errors import ConfigError

# setting -> (default, quick, cuda) where the three differ
_PRESETS = {
    "examples": (24, 8, 64),
    "per_step": (6, 4, 8),
    "repeats": (3, 2, 3),
    "warmup": (1, 1, 1),
    "length_scale": ("auto:600", "auto:200", 1.0),
    "model_size": ("default", "quick", "medium"),
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="throughput of standard DPO vs prefix sharing (with/without packing) on this machine",
        description=(
            "Runs a full DPO step (policy forward+backward, reference forward, AdamW) in four modes - paired, "
            "paired-packed, shared, shared-packed - on the same examples, interleaved and repeated, and reports "
            "pairs/s, tokens/s, peak memory, speedups beside the paper's and the FLOP model's ideal."
        ),
    )
    p.add_argument("--quick", action="store_true", help="small, fast run (about a minute on 2 CPU cores)")
    p.add_argument("--task", default="dpo", choices=["dpo", "reward", "grpo", "reuse"],
                   help="dpo: a DPO step (policy + reference); reward: a reward-model step (Bradley-Terry, as TRL's "
                        "RewardTrainer: one scoring pass, no reference, no LM head), with its own ideal; grpo: the "
                        "training part of a GRPO step (TRL's GRPOTrainer) in TRL's layout vs prefix-shared, on "
                        "synthetic rollouts of three profiles, and generation's share of a whole step; reuse: a "
                        "long prompt (8-16k tokens, --quick 1-2k) with 8 responses over a per-pass budget, as one "
                        "row, split into a row per pair (the prompt repeated), and with prefix reuse (time, peak "
                        "memory)")
    p.add_argument("--profiles", default=None,
                   help="comma-separated synthetic profiles (default: all six of the paper, the multi-response one "
                        "and the shared-prefix ones, shp-like (5-10 pair records per post; adds the grouped-packed "
                        "mode, --group_by_prompt), system-prompt and multi-turn; --task grpo: math-like, long-context, "
                        "math-like-g16)")
    p.add_argument("--dataset", default=None, help="a real preference dataset instead of synthetic profiles")
    p.add_argument("--tokenizer", default=None, help="tokenizer for --dataset (default: --model's)")
    p.add_argument("--split", default="train", help="dataset split (default train)")
    p.add_argument("--max-length", type=int, default=None, help="max tokens per prefix-shared row (dataset)")
    p.add_argument("--model", default=None, help="a real model (path or hub name) instead of the built-in one")
    p.add_argument("--model-size", default=None, choices=["default", "quick", "medium"],
                   help="built-in random Llama-shaped model size")
    p.add_argument("--device", default="cpu", help="cpu (fp32, SDPA) or cuda (bf16, compiled FlexAttention)")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "segmented", "flex", "varlen"],
                   help="attention backend for every mode (auto: flex on CUDA, segmented on CPU)")
    p.add_argument("--packing", default="auto", choices=["auto", "lines", "step"],
                   help="packed modes: 'lines' = bin-pack into lines of the common pack length; 'step' = each "
                        "step's examples in one line (needs an attention that skips masked blocks); "
                        "auto = step with segmented attention, else lines")
    p.add_argument("--examples", type=int, default=None, help="examples per profile")
    p.add_argument("--per-step", type=int, default=None, help="examples per optimizer step (same in every mode)")
    p.add_argument("--repeats", type=int, default=None, help="counted passes over the examples")
    p.add_argument("--warmup", type=int, default=None, help="uncounted passes first")
    p.add_argument("--length-scale", type=float, default=None,
                   help="multiply the profiles' median lengths (1 = the paper's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the cores left idle by the 1-minute load average, >= 1)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="what steps are timed with: wall (default) or cpu, this process's CPU seconds, which leave out "
                        "the time other jobs on a shared machine take (CPU devices; use with --threads 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--trust-remote-code", action="store_true")
    # --task grpo only (prefixdpo.bench.grpo_report)
    p.add_argument("--rollouts", type=int, default=None, help="grpo: rollouts (optimizer steps) per profile")
    p.add_argument("--beta", type=float, default=0.04, help="grpo: KL coefficient; > 0 adds the reference pass")
    p.add_argument("--num-iterations", type=int, default=1,
                   help="grpo: policy updates per rollout; > 1 adds the old-policy pass")
    p.set_defaults(func=run)


def _setting(args, name: str, cuda: bool):
    value = getattr(args, name)
    if value is not None:
        return value
    default, quick, on_cuda = _PRESETS[name]
    return quick if args.quick else (on_cuda if cuda else default)


def _idle_cores() -> int:
    """Cores not busy with other processes. OpenMP threads beyond the idle cores spin at every barrier
    waiting for a descheduled sibling: measured here, a step took 3 s with 2 threads on a 2-core machine
    busy with two other jobs, and 0.04 s with 1 thread."""
    cores = os.cpu_count() or 1
    try:
        busy = int(round(os.getloadavg()[0]))
    except OSError:
        busy = 0
    return max(1, min(cores, cores - busy))


def _workloads(args, settings, vocab_size: int):
    from prefixdpo.bench.workloads import dataset_workload
    from prefixdpo.data.synthetic import BENCH_PROFILES as PROFILES  # the paper's six + multi-response
    from prefixdpo.data.synthetic import SHARED_PREFIX_PROFILES

    if args.dataset:
        tokenizer = args.tokenizer or args.model
        if not tokenizer:
            raise ConfigError("--dataset needs --tokenizer (or --model, whose tokenizer is used)")
        return [dataset_workload(args.dataset, tokenizer, settings["examples"], settings["per_step"],
                                 split=args.split, max_length=args.max_length, vocab_size=vocab_size,
                                 trust_remote_code=args.trust_remote_code)]
    known = {**PROFILES, **SHARED_PREFIX_PROFILES}
    names = [n.strip() for n in args.profiles.split(",")] if args.profiles else list(known)
    for n in names:
        if n not in known:
            raise ConfigError(f"unknown profile {n!r}; known: {', '.join(known)}")
    return [_workload(n, known[n], settings, vocab_size, args.seed) for n in names]


def _workload(name: str, profile, settings, vocab_size: int, seed: int):
    """The workload of one profile. A shared-prefix profile counts prompts: `examples` of them and `per_step` per
    step, halved where a prompt holds several pair records (an shp-like post holds 5-10, a multi-turn dialogue
    3-5), so its steps stay near the other profiles' size."""
    from prefixdpo.bench.workloads import shared_prefix_workload, synthetic_workload
    from prefixdpo.data.synthetic import SHARED_PREFIX_PROFILES

    scale = _length_scale(settings["length_scale"], profile)
    if name not in SHARED_PREFIX_PROFILES:
        return synthetic_workload(name, settings["examples"], settings["per_step"], vocab_size=vocab_size, seed=seed,
                                  length_scale=scale)
    several = profile.pairs_per_prompt[1] > 1 or profile.turns[1] > 1
    prompts = max(2, settings["examples"] // 2) if several else settings["examples"]
    per_step = max(1, settings["per_step"] // 2) if several else settings["per_step"]
    return shared_prefix_workload(name, prompts, per_step, vocab_size=vocab_size, seed=seed, length_scale=scale)


def _length_scale(value, profile) -> float:
    """"auto:N": the paper's lengths up to a median (prompt + one completion) of N tokens, longer profiles
    scaled down to it, so the run fits in minutes on 2 CPU cores (N = 600 default, 200 --quick). A
    uniform scale would shrink the short profiles too, and a fixed per-step cost (optimizer, Python,
    per-call overheads) is a larger share of a tiny step, diluting every speedup towards 1."""
    if isinstance(value, str) and value.startswith("auto:"):
        return min(1.0, int(value.split(":")[1]) / profile.median_total)
    return float(value)


def run(args) -> int:
    if args.task == "reuse":
        from prefixdpo.bench.prefix_reuse import run as run_reuse_bench

        return run_reuse_bench(args, threads=args.threads or _idle_cores())
    if args.task == "grpo":
        from prefixdpo.bench.grpo_report import run_group_bench

        return run_group_bench(args, threads=args.threads or _idle_cores())
    import torch
    from tqdm.auto import tqdm

    from prefixdpo.bench.chart import plot_results
    from prefixdpo.bench.memory import PeakMemory
    from prefixdpo.bench.model import SHAPES, build_models
    from prefixdpo.bench.report import markdown_report, to_json
    from prefixdpo.bench.runner import run_workload, workload_modes
    from prefixdpo.bench.step import DPOStep
    from prefixdpo.bench.clock import step_clock

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    settings = {k: _setting(args, k, cuda) for k in _PRESETS}
    clock = step_clock(args.clock, args.device)
    for k in ("examples", "per_step", "repeats"):
        if settings[k] < 1:
            raise ConfigError(f"--{k.replace('_', '-')} must be >= 1, got {settings[k]}")
    torch.set_num_threads(args.threads or _idle_cores())
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = args.attention if args.attention != "auto" else ("flex" if cuda else "segmented")
    # One line per step only where attention skips masked blocks without compiling per shape: segmented.
    # Flex compiles per line length, so on CUDA the packed modes keep the fixed common pack length.
    line_per_step = args.packing == "step" or (args.packing == "auto" and backend == "segmented")
    line_multiple = 128 if backend == "flex" else 8  # flex's block size; the others skip padding's attention
    model = args.model or SHAPES[settings["model_size"]]
    reward = args.task == "reward"
    if reward:
        from prefixdpo.bench.reward import RewardStep, build_reward_model

        policy, shape = build_reward_model(model, device=args.device, dtype=dtype, backend=backend, seed=args.seed,
                                           trust_remote_code=args.trust_remote_code)
        stepper = RewardStep(policy, backend=backend)
    else:
        policy, reference, shape = build_models(model, device=args.device, dtype=dtype, backend=backend,
                                                seed=args.seed, trust_remote_code=args.trust_remote_code)
        stepper = DPOStep(policy, reference, backend=backend)
    workloads = _workloads(args, settings, shape.vocab)
    if args.dataset:  # a record over the model's positions: one line, before the first step
        from prefixdpo.core.fit import check_positions

        check_positions(policy, workloads[0].examples, args.dataset)
    pad_id = getattr(policy.config, "pad_token_id", None) or 0

    steps = sum(len(w.groups) * len(workload_modes(w, trie=True)) for w in workloads) * (
        settings["warmup"] + settings["repeats"])
    results = []
    t0 = time.perf_counter()
    with tqdm(total=steps, unit="step", disable=args.no_progress) as bar:
        for w in workloads:
            bar.set_description(w.name)
            results.append(run_workload(w, stepper, shape, device=args.device, repeats=settings["repeats"],
                                        warmup=settings["warmup"], progress=bar, pad_token_id=pad_id,
                                        line_per_step=line_per_step, trie=True,
                                        line_multiple=line_multiple, clock=clock))
    elapsed = time.perf_counter() - t0
    if reward:
        from prefixdpo.bench.flops import step_ideals
        from prefixdpo.bench.reward import no_head, reward_ideal_speedup, reward_flop_split

        for w, r in zip(workloads, results):  # the paper measured DPO: its numbers are not this task's
            r.ideal, r.paper = reward_ideal_speedup(shape, w.examples), None
            r.ideals = step_ideals(shape, [[w.examples[i] for i in g] for g in w.groups], keep=no_head)
            r.flop_split = {k: reward_flop_split(shape, w.examples, shared=k == "shared") for k in r.flop_split}

    model_desc = args.model or (f"random Llama-shaped ({settings['model_size']}): hidden {shape.hidden}, "
                                f"intermediate {shape.intermediate}, {shape.layers} layers, {shape.heads} heads "
                                f"/ {shape.kv_heads} KV, head_dim {shape.head_dim}, vocab {shape.vocab}")
    meta = {
        "task": ("reward model: one scoring pass with grad + AdamW per step, Bradley-Terry loss, no reference "
                 "and no LM head; ideal = body + attention FLOPs of standard / prefix-shared rows (the paper's "
                 "columns are DPO's, so left empty)") if reward else
                "DPO: policy forward + backward, reference forward, AdamW per step",
        "device": (f"{args.device} ({torch.cuda.get_device_name()}), bf16" if cuda else
                   f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), fp32")
                  + f", attention backend '{backend}' in every mode",
        "model": model_desc,
        "settings": (f"{settings['examples']} examples per profile, {settings['per_step']} per optimizer step, "
                     f"{settings['warmup']} warm-up + {settings['repeats']} counted passes, modes interleaved "
                     f"step by step; length scale {settings['length_scale']} (auto:N = the paper's lengths up to a median "
                     "of N tokens, longer profiles scaled down to it; per profile below); "
                     + (f"packed modes: each step's examples in one line, padded to a multiple of {line_multiple}"
                        if line_per_step else "one pack length for both packed modes (1.1 x p95 of the shared "
                        "rows, rounded up to 128)")),
        "memory": PeakMemory(args.device).method,
        "timing": f"{elapsed:.0f} s; steps timed by {args.clock} clock ({'CPU seconds of this process' if args.clock == 'cpu' else 'wall seconds'}); torch {torch.__version__}; collation (layout/packing) is not in the step time",
    }
    out = Path(args.out)
    md = markdown_report(results, meta)
    atomic_write_text(str(out / "bench.md"), md)
    atomic_write_text(str(out / "bench.json"), to_json(results, meta))
    plot_results(results, out / "bench.png")
    print(md)
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}, {out / 'bench.png'}")
    return 0
