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

# hybrids the built-in bench model can be (`prefixdpo_tools.hybrid_models`), spelled out: the parser must not import
# the tools (tested equal)
BENCH_ARCHITECTURES = ("qwen3_5_text", "lfm2", "nemotron_h", "kimi_linear")


# the command's line in `prefixdpo --help`, and the head of its own help
SUMMARY = "throughput of standard DPO vs prefix sharing (with/without packing) on this machine"
DESCRIPTION = (
    "Runs a full DPO step (policy forward+backward, reference forward, AdamW) in four modes - paired, paired-packed, "
    "shared, shared-packed (and grouped/trie-packed where records share a prompt) - interleaved and repeated; reports "
    "pairs/s, tokens/s, peak memory, speedups beside their ideals. --task reward / grpo / reuse: those steps instead."
)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help=SUMMARY, description=DESCRIPTION)
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
    p.add_argument("--architecture", default="llama", choices=["llama", *BENCH_ARCHITECTURES],
                   help="the built-in model's architecture: Llama (default), or a hybrid at the same size (its "
                        "recurrent layers alternate with attention; the ideal counts their linear cost)")
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
    # --task grpo only (prefixdpo_tools.bench.grpo_report)
    p.add_argument("--rollouts", type=int, default=None, help="grpo: rollouts (optimizer steps) per profile")
    p.add_argument("--beta", type=float, default=0.04, help="grpo: KL coefficient; > 0 adds the reference pass")
    p.add_argument("--num-iterations", type=int, default=1,
                   help="grpo: policy updates per rollout; > 1 adds the old-policy pass")
    p.set_defaults(func=run)


def idle_cores() -> int:
    """Cores not busy with other processes. OpenMP threads beyond the idle cores spin at every barrier
    waiting for a descheduled sibling: measured here, a step took 3 s with 2 threads on a 2-core machine
    busy with two other jobs, and 0.04 s with 1 thread."""
    cores = os.cpu_count() or 1
    try:
        busy = int(round(os.getloadavg()[0]))
    except OSError:
        busy = 0
    return max(1, min(cores, cores - busy))


def run(args) -> int:
    threads = args.threads or idle_cores()
    if args.task == "reuse":
        from prefixdpo_tools.bench.prefix_reuse import run as run_reuse_bench

        return run_reuse_bench(args, threads=threads)
    if args.task == "grpo":
        from prefixdpo_tools.bench.grpo_report import run_group_bench

        return run_group_bench(args, threads=threads)
    from prefixdpo_tools.bench.pair_report import run_pair_bench

    return run_pair_bench(args, threads=threads)
