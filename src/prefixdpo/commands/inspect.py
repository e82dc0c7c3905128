"""`prefixdpo inspect`: what a dataset looks like after preparation, and what prefix sharing gains on it.

    prefixdpo inspect DATASET --tokenizer PATH [--model-config PATH] [--show-mask PNG] [train's data options:
                      --max-length N --truncation-mode M --invalid error|skip --pairs-policy P --overlong O
                      --max-samples N --dataset-train-split S --dataset-test-split S --pack-length auto|N ...]

The data options are train's (`PrefixDPOConfig` / `DataArguments` fields, same names, defaults and checks,
turned into `DataOptions` by the same `config.data_options`), so the data is prepared exactly as `train`
would: over-long sequences truncated or dropped and counted, a bad record an error unless `--invalid skip`.
Prints the preparation report (kept / skipped by reason / truncated / dropped / boundary adjustments),
length statistics, tokens saved vs standard DPO (by per-record sharing, and apart what `--group_by_prompt` would
save on top), packing efficiency and the FLOP-model speedup of each (for Llama-3.1-8B unless `--model-config`
names a config.json or model directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from prefixdpo.errors import UserError


# inspect reads no eval_strategy: it reports a held-out split when one is named
TEST_SPLIT = ("dataset_test_split", str | None,
              dataclasses.field(default=None, metadata={"help": "Also report this held-out split."}))


def _options_from(dataclass_type, names, replaced=()) -> type:
    """A dataclass holding only the fields `names` of `dataclass_type` (same types, defaults and help), for
    `HfArgumentParser`: inspect's options are train's, spelled and defaulted the same, except the `replaced`
    (name, type, field) ones."""
    hints = typing.get_type_hints(dataclass_type)
    own = {name: (name, hint, spec) for name, hint, spec in replaced}
    return dataclasses.make_dataclass(
        f"{dataclass_type.__name__}Subset",
        [own.get(f.name) or (f.name, hints[f.name], dataclasses.field(default=f.default, metadata=f.metadata))
         for f in dataclasses.fields(dataclass_type) if f.name in names],
    )


def _train_options():
    """The `PrefixDPOConfig` / `DataArguments` fields inspect takes from train: every DataArguments field but
    the dataset (DATASET here) and those of a training run only (streaming, DDP buffers); the config fields
    `data_options` passes on (those named like a `DataOptions` field: max_length, truncation_mode);
    `pack_length` for the packing figure; `trust_remote_code`."""
    from prefixdpo.dpo.config import DataArguments, PrefixDPOConfig
    from prefixdpo.data.prepare import DataOptions

    option_names = {f.name for f in dataclasses.fields(DataOptions)}
    config_names = {f.name for f in dataclasses.fields(PrefixDPOConfig) if f.name in option_names}
    config_names |= {"pack_length", "trust_remote_code"}
    data_names = {f.name for f in dataclasses.fields(DataArguments)} - {
        "dataset_name", "dataset_streaming", "ignore_bias_buffers"}
    return _options_from(PrefixDPOConfig, config_names), _options_from(DataArguments, data_names, [TEST_SPLIT])


def register(subparsers) -> None:
    from transformers import HfArgumentParser

    config_options, data_options = _train_options()
    train_parser = HfArgumentParser((config_options, data_options), add_help=False)
    p = subparsers.add_parser(
        "inspect",
        parents=[train_parser],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="length statistics, tokens saved and predicted speedup of prefix sharing on a dataset",
        description=(
            "Loads and tokenizes a preference dataset exactly as training would (train's data options and "
            "defaults), then reports what was kept, skipped or cut, the prompt/response/row lengths, tokens saved "
            "vs standard DPO, packing efficiency and the speedup predicted by a useful-FLOP model."
        ),
    )
    p.add_argument("dataset", metavar="DATASET",
                   help="a .jsonl/.json/.parquet/.csv file, a save_to_disk directory, or a Hub dataset name")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory or Hub name (AutoTokenizer)")
    p.add_argument("--model-config", default=None,
                   help="config.json or model directory for the FLOP model (default: Llama-3.1-8B's shape)")
    p.add_argument("--max-tokens-per-pass", type=int, default=4096,
                   help="prefix reuse's budget for the activation-memory figure (`--prefix_reuse` of train)")
    p.add_argument("--show-mask", metavar="PNG", default=None,
                   help="draw the attention mask of the first packed line (documents, prompt, branches, padding)")
    p.set_defaults(func=run, config_fields=[f.name for f in dataclasses.fields(config_options)],
                   data_fields=[f.name for f in dataclasses.fields(data_options)])


def _shape(model_config: str | None):
    from prefixdpo_tools.bench.flops import LLAMA_3_1_8B, ModelShape

    if model_config is None:
        return LLAMA_3_1_8B, "Llama-3.1-8B"
    from pathlib import Path

    from transformers import AutoConfig

    path = Path(model_config)
    cfg = AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
    return ModelShape.from_config(cfg), model_config


def run(args) -> int:
    from prefixdpo.dpo.config import DataArguments, PrefixDPOConfig, data_options
    from prefixdpo.data.prepare import prepare_examples
    from prefixdpo.data.grouping import group_by_prompt
    from prefixdpo.data.stats import compute_stats

    # The same dataclasses and `data_options` as train, so validation, defaults and preparation are train's.
    # packing=True: inspect always reports the packed figure, so its pack_length has an effect
    config = PrefixDPOConfig(packing=True, **{name: getattr(args, name) for name in args.config_fields})
    data = {name: getattr(args, name) for name in args.data_fields}
    test_split = data.pop("dataset_test_split")
    options = data_options(config, DataArguments(dataset_name=args.dataset, **data))
    options.eval_split = test_split
    from prefixdpo.core.models import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer, trust_remote_code=config.trust_remote_code)
    shape, model_name = _shape(args.model_config)
    prepared = prepare_examples(args.dataset, tokenizer, options)
    print(prepared.report.summary())
    if prepared.eval_report is not None:
        print(f"Held-out split {options.eval_split!r}: {prepared.eval_report.summary()}")
    if not prepared.examples:
        print("No examples left to inspect.")
        return 1
    grouped, _ = group_by_prompt(prepared.examples)  # what --group_by_prompt would run, reported apart
    speedup = grouped_speedup = None
    if shape is not None:
        from prefixdpo_tools.bench.flops import ideal_speedup

        speedup = ideal_speedup(shape, prepared.examples)
        grouped_speedup = ideal_speedup(shape, prepared.examples, shared_rows=grouped)
    stats = compute_stats(prepared.examples, config.pack_length, speedup=speedup, model_name=model_name,
                          grouped=grouped, grouped_speedup=grouped_speedup)
    stats = _with_trie(stats, prepared.examples, grouped, shape)
    print(stats.format())
    if shape is not None:
        print(_activation_report(prepared.examples, shape, model_name, args.max_tokens_per_pass))
    if args.show_mask:
        drawn = _draw_first_line(prepared.examples, stats.pack_length, args.show_mask)
        print(f"attention mask of one packed line written to {drawn}")
        if stats.trie_tokens < stats.shared_tokens:
            drawn = _draw_first_tree_line(prepared.examples, stats.pack_length, args.show_mask)
            print(f"attention mask of one token-trie line written to {drawn}")
    return 0


def _activation_report(examples, shape, model_name: str, budget: int) -> str:
    """Two lines: the peak activation memory of one example's training pass, as one row and with prefix reuse at
    `budget` tokens a pass (the prompt once and its largest chunk), for the largest example and the median (bf16,
    `core.fit.block_activation_bytes`: an estimate from the model's shape)."""
    import statistics

    from prefixdpo.core.attention.reuse_plan import reused_tokens
    from prefixdpo.core.fit import block_activation_bytes

    per_token = block_activation_bytes(shape.hidden, shape.intermediate, shape.kv_heads * shape.head_dim,
                                       shape.layers, 2)
    rows = [ex.shared_length for ex in examples]
    reused = [reused_tokens(len(ex.prompt_ids), [len(r) for r in ex.response_ids], budget) for ex in examples]
    over = sum(r > budget for r in rows)

    def gib(tokens: float) -> str:
        return f"{tokens * per_token / 2**30:.2f} GiB"

    return (f"activations         per example's training pass ({model_name}, bf16, estimated): largest {gib(max(rows))},"
            f" median {gib(statistics.median(rows))} as one row\n"
            f"                    with --prefix_reuse at {budget} tokens a pass (the prompt once, then chunks): "
            f"largest {gib(max(reused))}, median {gib(statistics.median(reused))}; {over} of {len(rows)} examples "
            "run as a prefix and chunks")


def _with_trie(stats, examples, grouped, shape):
    """`stats` with what `prefix_tree=true` would run: training's own lines of tries over the records
    (`data.tree.plan_tree_lines` at the pack length), and its FLOP-model speedup over standard DPO."""
    import dataclasses

    from prefixdpo.data.tree import plan_tree_lines, tree_line

    lines = [[examples[i] for i in line] for line in plan_tree_lines(examples, stats.pack_length).lines]
    speedup = None
    if shape is not None:
        from prefixdpo_tools.bench.flops import standard_flops, trie_flop_count

        speedup = (sum(standard_flops(shape, ex) for ex in examples)
                   / sum(trie_flop_count(shape, line).total for line in lines))
    return dataclasses.replace(stats, trie_lines=len(lines), trie_tokens=sum(len(tree_line(line)) for line in lines),
                               trie_speedup=speedup)


def _draw_first_tree_line(examples, pack_length: int, path: str):
    """Draw the first line of tries `prefix_tree=true` would train on (`_with_trie`'s lines) beside `path`:
    NAME-trie.png."""
    from pathlib import Path

    from prefixdpo.core.attention.draw import draw_mask
    from prefixdpo.data.tree import build_tree_batch, plan_tree_lines

    first = [examples[i] for i in plan_tree_lines(examples, pack_length).lines[0]]
    target = Path(path)
    return draw_mask(build_tree_batch(first), target.with_name(f"{target.stem}-trie{target.suffix}"),
                     title="token trie across records (prefix_tree=true)")


def _draw_first_line(examples, pack_length: int, path: str):
    """Pack the examples that fit (first-fit, without shuffling) and draw the first packed line."""
    from prefixdpo.core.attention.draw import draw_mask
    from prefixdpo.data.batch import build_batch
    from prefixdpo.data.packing import plan_packs

    fitting = [e for e in examples if e.shared_length <= pack_length][:64]
    if not fitting:
        raise UserError(f"no example fits the pack length {pack_length}; pass a larger --pack-length")
    first = plan_packs([e.shared_length for e in fitting], pack_length, shuffle=False)[0]
    batch = build_batch([fitting[i] for i in first], packs=[list(range(len(first)))], length=pack_length)
    return draw_mask(batch, path)
