"""`prefixdpo bench --task dpo` / `--task reward`: settings, the run, and its report (bench.md / bench.json /
bench.png), as `grpo_report` is `--task grpo`'s.

Defaults (CPU, fp32): the six synthetic profiles at half the paper's lengths on a 4-layer Llama-shaped model (about
10 minutes on 2 cores); `--quick`: quarter lengths, 2 layers (about a minute). CUDA: bf16, compiled FlexAttention, the
paper's lengths and an 8-layer model unless given.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from prefixdpo.atomic_io import atomic_write_text
from prefixdpo.errors import ConfigError

# setting -> (default, quick, cuda) where the three differ
PRESETS = {
    "examples": (24, 8, 64),
    "per_step": (6, 4, 8),
    "repeats": (3, 2, 3),
    "warmup": (1, 1, 1),
    "length_scale": ("auto:600", "auto:200", 1.0),
    "model_size": ("default", "quick", "medium"),
}


def _setting(args, name: str, cuda: bool):
    value = getattr(args, name)
    if value is not None:
        return value
    default, quick, on_cuda = PRESETS[name]
    return quick if args.quick else (on_cuda if cuda else default)


def _workloads(args, settings, vocab_size: int):
    from prefixdpo_tools.bench.workloads import dataset_workload
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
    from prefixdpo_tools.bench.workloads import shared_prefix_workload, synthetic_workload
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


def settings_of(args, cuda: bool) -> dict:
    """The run's settings: each option given on the command line, else the preset of --quick / CUDA / CPU."""
    settings = {k: _setting(args, k, cuda) for k in PRESETS}
    for k in ("examples", "per_step", "repeats"):
        if settings[k] < 1:
            raise ConfigError(f"--{k.replace('_', '-')} must be >= 1, got {settings[k]}")
    return settings


def architecture_model(shape, architecture: str):
    """The built-in bench model: `shape` (a random Llama), or a hybrid config of `architecture` at its size."""
    if architecture == "llama":
        return shape
    from prefixdpo_tools.hybrid_models import hybrid_config

    return hybrid_config(architecture, hidden=shape.hidden, intermediate=shape.intermediate, layers=shape.layers,
                         heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim, vocab=shape.vocab)


def build_stepper(args, settings: dict, dtype, backend: str):
    """(policy, its shape, the step every mode runs): a DPO step (policy + reference) or a reward-model step."""
    from prefixdpo_tools.bench.model import SHAPES, build_models
    from prefixdpo_tools.bench.step import DPOStep

    model = args.model or architecture_model(SHAPES[settings["model_size"]], getattr(args, "architecture", "llama"))
    if args.task == "reward":
        from prefixdpo_tools.bench.reward import RewardStep, build_reward_model

        policy, shape = build_reward_model(model, device=args.device, dtype=dtype, backend=backend, seed=args.seed,
                                           trust_remote_code=args.trust_remote_code)
        return policy, shape, RewardStep(policy, backend=backend)
    policy, reference, shape = build_models(model, device=args.device, dtype=dtype, backend=backend,
                                            seed=args.seed, trust_remote_code=args.trust_remote_code)
    return policy, shape, DPOStep(policy, reference, backend=backend)


def roofline_probe(task: str, dtype: torch.dtype, cuda: bool):
    """The roofline's matmul (`bench.roofline`): 2048^3 on CPU, 8192^3 on CUDA, in the step's dtype; a reward step
    runs 3 forwards' worth (forward, backward) without the LM head, a DPO step 4 (the reference's forward too)."""
    from prefixdpo_tools.bench.roofline import RooflineProbe

    n = 8192 if cuda else 2048
    if task == "reward":
        from prefixdpo_tools.bench.reward import no_head

        return RooflineProbe(dtype, n, forwards_per_step=3, keep=no_head)
    return RooflineProbe(dtype, n)


def reward_figures(workloads, results, shape) -> None:
    """A reward model's ideal and FLOP split in place of DPO's (the paper measured DPO: its numbers are not this
    task's)."""
    from prefixdpo_tools.bench.flops import step_ideals
    from prefixdpo_tools.bench.reward import no_head, reward_flop_split, reward_ideal_speedup

    for w, r in zip(workloads, results):
        r.ideal, r.paper = reward_ideal_speedup(shape, w.examples), None
        r.ideals = step_ideals(shape, [[w.examples[i] for i in g] for g in w.groups], keep=no_head)
        r.flop_split = {k: reward_flop_split(shape, w.examples, shared=k == "shared") for k in r.flop_split}


def run_meta(args, settings: dict, shape, backend: str, line_per_step: bool, line_multiple: int,
             elapsed: float) -> dict:
    """The facts the report opens with: task, device, model, settings, memory method, timing."""
    from prefixdpo_tools.bench.memory import PeakMemory

    cuda = args.device.startswith("cuda")
    architecture = getattr(args, "architecture", "llama")
    kind = "Llama-shaped" if architecture == "llama" else (
        f"{architecture} hybrid ({shape.pair_layers} of {shape.layers} layers attention, the others recurrent)")
    model_desc = args.model or (f"random {kind} ({settings['model_size']}): hidden {shape.hidden}, "
                                f"intermediate {shape.intermediate}, {shape.layers} layers, {shape.heads} heads "
                                f"/ {shape.kv_heads} KV, head_dim {shape.head_dim}, vocab {shape.vocab}")
    return {
        "task": ("reward model: one scoring pass with grad + AdamW per step, Bradley-Terry loss, no reference "
                 "and no LM head; ideal = body + attention FLOPs of standard / prefix-shared rows (the paper's "
                 "columns are DPO's, so left empty)") if args.task == "reward" else
                "DPO: policy forward + backward, reference forward, AdamW per step",
        "device": (f"{args.device} ({torch.cuda.get_device_name()}), bf16" if cuda else
                   f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), fp32")
                  + f", attention backend '{backend}' in every mode",
        "model": model_desc,
        "settings": (f"{settings['examples']} examples per profile, {settings['per_step']} per optimizer step, "
                     f"{settings['warmup']} warm-up + {settings['repeats']} counted passes, modes interleaved "
                     f"step by step; length scale {settings['length_scale']} (auto:N = the paper's lengths up to a "
                     "median of N tokens, longer profiles scaled down to it; per profile below); "
                     + (f"packed modes: each step's examples in one line, padded to a multiple of {line_multiple}"
                        if line_per_step else "one pack length for both packed modes (1.1 x p95 of the shared "
                        "rows, rounded up to 128)")),
        "memory": PeakMemory(args.device).method,
        "timing": (f"{elapsed:.0f} s; steps timed by {args.clock} clock "
                   f"({'CPU seconds of this process' if args.clock == 'cpu' else 'wall seconds'}); "
                   f"torch {torch.__version__}; collation (layout/packing) is not in the step time"),
    }


def write_report(results, meta: dict, out: Path) -> None:
    """bench.md (printed too), bench.json and bench.png in `out`."""
    from prefixdpo_tools.bench.chart import plot_results
    from prefixdpo_tools.bench.report import markdown_report, to_json

    md = markdown_report(results, meta)
    atomic_write_text(str(out / "bench.md"), md)
    atomic_write_text(str(out / "bench.json"), to_json(results, meta))
    plot_results(results, out / "bench.png")
    print(md)
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}, {out / 'bench.png'}")


def run_pair_bench(args, *, threads: int) -> int:
    """`prefixdpo bench --task dpo|reward` (see the module doc and `prefixdpo_tools.bench.runner`)."""
    from tqdm.auto import tqdm

    from prefixdpo_tools.bench.clock import step_clock
    from prefixdpo_tools.bench.runner import run_workload, workload_modes

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    clock = step_clock(args.clock, args.device)
    settings = settings_of(args, cuda)
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = args.attention if args.attention != "auto" else ("flex" if cuda else "segmented")
    # One line per step only where attention skips masked blocks without compiling per shape: segmented.
    # Flex compiles per line length, so on CUDA the packed modes keep the fixed common pack length.
    line_per_step = args.packing == "step" or (args.packing == "auto" and backend == "segmented")
    line_multiple = 128 if backend == "flex" else 8  # flex's block size; the others skip padding's attention
    policy, shape, stepper = build_stepper(args, settings, dtype, backend)
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
                                        line_multiple=line_multiple, clock=clock,
                                        roofline=roofline_probe(args.task, dtype, cuda)))
    elapsed = time.perf_counter() - t0
    if args.task == "reward":
        reward_figures(workloads, results, shape)
    write_report(results, run_meta(args, settings, shape, backend, line_per_step, line_multiple, elapsed),
                 Path(args.out))
    return 0
