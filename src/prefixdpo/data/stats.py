"""Length statistics of prepared examples and what prefix sharing and packing should gain on them.

- lengths: median / p95 / max of prompt, response and prefix-shared row lengths (tokens);
- prompt/response ratio: median over examples of P / mean_k R_k (the paper's "prompt/completion ratio");
- token saving: 1 - shared / unshared tokens, where a shared row is P + sum_k R_k and standard DPO runs
  sum_k (P + R_k); and, apart, what `group_by_prompt` saves on top (one row per prompt, each distinct response
  once: 1 - grouped / shared tokens) and what a token trie across records would save on top of that (`prefix_tree`'s
  lines of tries, `data.tree.plan_tree_lines`: each line's shared leading tokens once);
- packing efficiency: real tokens / (packs x pack length) when the shared rows are bin-packed
  (`packing.plan_packs`) at the chosen pack length (`auto` = 1.1 x p95 rounded up to 128);
- predicted speedup: the useful-FLOP model of `prefixdpo_tools.bench.flops` (body matmuls + allowed attention pairs + LM
  head at response-predicting positions, standard DPO / prefix sharing) for a given model shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prefixdpo.data.example import Example
from prefixdpo.errors import UserError


@dataclass(frozen=True)
class Lengths:
    median: float
    p95: float
    max: int

    @classmethod
    def of(cls, values: Sequence[int]) -> Lengths:
        arr = np.asarray(values, dtype=np.float64)
        return cls(float(np.median(arr)), float(np.quantile(arr, 0.95)), int(arr.max()))

    def __str__(self) -> str:
        return f"median {self.median:g}, p95 {self.p95:g}, max {self.max}"


@dataclass(frozen=True)
class DataStats:
    """Statistics of a list of examples (see module docstring). `speedup`/`model` are None without a shape."""

    examples: int
    responses: int
    prompt: Lengths
    response: Lengths
    row: Lengths
    prompt_response_ratio: float
    shared_tokens: int
    unshared_tokens: int
    pack_length: int
    packs: int
    rows_over_pack_length: int
    packing_efficiency: float
    model: str | None = None
    speedup: float | None = None
    grouped_rows: int | None = None
    grouped_tokens: int | None = None
    grouped_speedup: float | None = None
    trie_lines: int | None = None
    trie_tokens: int | None = None
    trie_speedup: float | None = None

    @property
    def token_saving(self) -> float:
        """1 - shared / unshared tokens: the fraction of standard DPO's tokens prefix sharing does not run."""
        return 1.0 - self.shared_tokens / self.unshared_tokens

    def _beyond_records(self) -> list[str]:
        """The lines of what group_by_prompt, then a token trie, would save on top of per-record sharing."""
        lines = []
        if self.grouped_tokens is not None:
            lines.append(
                f"                    {self.grouping_saving:.1%} more by group_by_prompt ({self.examples} records -> "
                f"{self.grouped_rows} rows, {self.grouped_tokens} tokens): "
                f"{1.0 - self.grouped_tokens / self.unshared_tokens:.1%} vs standard DPO in all")
        if self.trie_tokens is not None and self.grouped_tokens is not None:
            lines.append(
                f"                    {1.0 - self.trie_tokens / self.grouped_tokens:.1%} more by a token trie across "
                f"records (prefix_tree=true: the records in {self.trie_lines} lines of tries of "
                f"{self.pack_length}, each line's shared leading tokens once: {self.trie_tokens} tokens): "
                f"{1.0 - self.trie_tokens / self.unshared_tokens:.1%} vs standard DPO in all")
        return lines

    @property
    def grouping_saving(self) -> float:
        """1 - grouped / shared tokens: the fraction of the per-record rows' tokens group_by_prompt does not run."""
        return 1.0 - self.grouped_tokens / self.shared_tokens if self.grouped_tokens is not None else 0.0

    def format(self) -> str:
        lines = [
            f"examples            {self.examples} ({self.responses} responses, "
            f"{self.responses / self.examples:.2f} per prompt)",
            f"prompt tokens       {self.prompt}",
            f"response tokens     {self.response}",
            f"shared row tokens   {self.row}",
            f"prompt/response     median ratio {self.prompt_response_ratio:.2f}",
            f"tokens saved        {self.token_saving:.1%} vs standard DPO by per-record sharing "
            f"({self.shared_tokens} shared vs {self.unshared_tokens} unshared tokens)",
            *self._beyond_records(),
            f"packing             {self.packing_efficiency:.1%} efficient at pack length {self.pack_length} "
            f"({self.packs} packs)",
        ]
        if self.rows_over_pack_length:
            lines.append(
                f"                    {self.rows_over_pack_length} rows exceed the pack length "
                "(left out of the packing figure; truncate or drop them)"
            )
        if self.speedup is not None:
            lines.append(
                f"predicted speedup   {self.speedup:.2f}x useful FLOPs, standard DPO / prefix sharing, for {self.model} "
                "(FLOP model: 2 x body weights per token + 4 x heads x head_dim per allowed attention pair per layer "
                "+ 2 x hidden x vocab per response-predicting position; padding not counted)"
            )
        if self.speedup is not None and self.grouped_speedup is not None:
            lines.append(
                f"                    {self.grouped_speedup:.2f}x with group_by_prompt "
                f"({self.grouped_speedup / self.speedup:.2f}x from grouping alone)"
            )
        if self.speedup is not None and self.trie_speedup is not None:
            lines.append(f"                    {self.trie_speedup:.2f}x with a token trie across records (not in "
                         "training yet)")
        return "\n".join(lines)


def compute_stats(
    examples: Sequence[Example],
    pack_length: int | str = "auto",
    speedup: float | None = None,
    model_name: str | None = None,
    seed: int = 0,
    grouped: Sequence[Example] | None = None,
    grouped_speedup: float | None = None,
) -> DataStats:
    """Statistics of `examples`. pack_length: "auto" (`packing.auto_pack_length`) or an int.
    speedup: the FLOP model's predicted speedup for a model (`bench.flops.ideal_speedup`), None = no prediction.
    grouped: `examples` grouped by prompt (`data.grouping.group_by_prompt`), for the tokens grouping saves on top
    of per-record sharing; grouped_speedup: the FLOP model's speedup of the grouped rows over standard DPO."""
    from prefixdpo.data.packing import auto_pack_length, packing_efficiency, plan_packs

    if not examples:
        raise UserError("no examples to compute statistics on (the dataset is empty)")
    prompts = [len(ex.prompt_ids) for ex in examples]
    responses = [len(r) for ex in examples for r in ex.response_ids]
    rows = [ex.shared_length for ex in examples]
    ratios = [len(ex.prompt_ids) * ex.num_responses / sum(len(r) for r in ex.response_ids) for ex in examples]
    length = auto_pack_length(rows) if pack_length == "auto" else int(pack_length)
    fitting = [n for n in rows if n <= length]
    packs = plan_packs(fitting, length, seed=seed) if fitting else []
    return DataStats(
        examples=len(examples),
        responses=len(responses),
        prompt=Lengths.of(prompts),
        response=Lengths.of(responses),
        row=Lengths.of(rows),
        prompt_response_ratio=float(np.median(ratios)),
        shared_tokens=sum(rows),
        unshared_tokens=sum(ex.unshared_length for ex in examples),
        pack_length=length,
        packs=len(packs),
        rows_over_pack_length=len(rows) - len(fitting),
        packing_efficiency=packing_efficiency(fitting, packs, length),
        model=model_name if speedup is not None else None,
        speedup=speedup,
        grouped_rows=None if grouped is None else len(grouped),
        grouped_tokens=None if grouped is None else sum(ex.shared_length for ex in grouped),
        grouped_speedup=grouped_speedup,
    )
