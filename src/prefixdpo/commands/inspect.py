"""`prefixdpo inspect`: what a dataset looks like after preparation, and what prefix sharing gains on it.

    prefixdpo inspect DATASET --tokenizer PATH [--split S] [--max-samples N] [--pack-length auto|N]
                      [--max-length N] [--max-prompt-length N] [--invalid error|skip] [--model-config PATH]

Prints the preparation report (kept / skipped by reason / truncated / dropped / boundary adjustments),
length statistics, tokens saved vs standard DPO, packing efficiency and the FLOP-model speedup
(for Llama-3.1-8B unless `--model-config` names a config.json or model directory).
"""

from __future__ import annotations


def _pack_length(value: str):
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"--pack-length must be 'auto' or a positive integer, got {value!r}") from None
    if n <= 0:
        raise ValueError(f"--pack-length must be positive, got {n}")
    return n


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="length statistics, tokens saved and predicted speedup of prefix sharing on a dataset",
        description=(
            "Loads and tokenizes a preference dataset exactly as training would, then reports what was kept, "
            "skipped or cut, the prompt/response/row lengths, tokens saved vs standard DPO, packing "
            "efficiency and the speedup predicted by a useful-FLOP model."
        ),
    )
    p.add_argument("dataset", metavar="DATASET",
                   help="a .jsonl/.json/.parquet/.csv file, a save_to_disk directory, or a Hub dataset name")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory or Hub name (AutoTokenizer)")
    p.add_argument("--split", default="train", help="split to inspect (default train)")
    p.add_argument("--dataset-config", default=None, help="Hub dataset configuration name")
    p.add_argument("--max-samples", type=int, default=None, help="use only the first N records")
    p.add_argument("--pack-length", type=_pack_length, default="auto",
                   help="'auto' (1.1 x p95 row length, rounded up to 128) or a token count (default auto)")
    p.add_argument("--max-length", type=int, default=None, help="max tokens per prefix-shared row")
    p.add_argument("--max-prompt-length", type=int, default=None, help="max prompt tokens")
    p.add_argument("--truncation-mode", default="keep_end", choices=["keep_end", "keep_start"])
    p.add_argument("--overlong", default="truncate", choices=["truncate", "drop"])
    p.add_argument("--invalid", default="skip", choices=["error", "skip"],
                   help="bad records: stop at the first (error) or count them (skip, default here)")
    p.add_argument("--pairs-policy", default="best_vs_worst", choices=["best_vs_worst", "best_vs_each", "all_pairs"])
    p.add_argument("--model-config", default=None,
                   help="config.json or model directory for the FLOP model (default: Llama-3.1-8B's shape)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own code")
    p.add_argument("--show-mask", metavar="PNG", default=None,
                   help="draw the attention mask of the first packed line (documents, prompt, branches, padding)")
    p.set_defaults(func=run)


def _shape(model_config: str | None):
    from prefixdpo.bench.flops import LLAMA_3_1_8B, ModelShape

    if model_config is None:
        return LLAMA_3_1_8B, "Llama-3.1-8B"
    from pathlib import Path

    from transformers import AutoConfig

    path = Path(model_config)
    cfg = AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
    return ModelShape.from_config(cfg), model_config


def run(args) -> int:
    from transformers import AutoTokenizer

    from prefixdpo.data.prepare import DataOptions, prepare_examples
    from prefixdpo.data.stats import compute_stats

    options = DataOptions(
        max_length=args.max_length,
        max_prompt_length=args.max_prompt_length,
        truncation_mode=args.truncation_mode,
        overlong=args.overlong,
        invalid=args.invalid,
        pairs_policy=args.pairs_policy,
        max_samples=args.max_samples,
        split=args.split,
        dataset_config=args.dataset_config,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=args.trust_remote_code)
    shape, model_name = _shape(args.model_config)
    prepared = prepare_examples(args.dataset, tokenizer, options)
    print(prepared.report.summary())
    if not prepared.examples:
        print("No examples left to inspect.")
        return 1
    stats = compute_stats(prepared.examples, args.pack_length, shape=shape, model_name=model_name)
    print(stats.format())
    if args.show_mask:
        print(f"attention mask of one packed line written to {_draw_first_line(prepared.examples, stats.pack_length, args.show_mask)}")
    return 0


def _draw_first_line(examples, pack_length: int, path: str):
    """Pack the examples that fit (first-fit, without shuffling) and draw the first packed line."""
    from prefixdpo.attention.draw import draw_mask
    from prefixdpo.data.batch import build_batch
    from prefixdpo.data.packing import plan_packs

    fitting = [e for e in examples if e.shared_length <= pack_length][:64]
    if not fitting:
        raise ValueError(f"no example fits the pack length {pack_length}; pass a larger --pack-length")
    first = plan_packs([e.shared_length for e in fitting], pack_length, shuffle=False)[0]
    batch = build_batch([fitting[i] for i in first], packs=[list(range(len(first)))], length=pack_length)
    return draw_mask(batch, path)
