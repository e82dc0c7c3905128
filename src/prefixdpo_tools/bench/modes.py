"""The four benchmark modes: how one group of examples is laid out into a `Batch`.

    paired         standard DPO as TRL runs it: each preference pair its own record, each side its own
                   `[prompt][response]` line, padded to the longest line of the group (two lines per
                   pair; K = 4 responses best-vs-each = 3 pairs = 6 lines, see `standard_examples`).
    paired-packed  standard DPO, padding-free: the same `[prompt][response]` sequences, each its own
                   document, bin-packed into lines of the common pack length (as OpenRLHF packs them).
    shared         prefix sharing: one `[prompt][resp 0][resp 1]...` line per example, padded.
    shared-packed  prefix sharing + packing: the shared rows bin-packed into lines of the pack length.
    grouped-packed `--group_by_prompt`: the group's records of one prompt in one row (each distinct response
                   once, `data.grouping`), those rows packed as shared-packed packs. Run only on workloads whose
                   steps hold several records of one prompt (`GROUPED_MODE`).
    trie-packed    a token trie across records (`data.tree`): the group's records in tree lines, every token
                   their sequences share with all tokens before it once (a system prompt, earlier turns); lines
                   planned as training's `prefix_tree` plans them (`plan_tree_lines`). Run only where a trie saves
                   a tenth of the grouped rows' tokens or more (`TRIE_MODE`).

Fairness of packing (our choice): both packed modes use ONE pack length per workload, the paper's rule
(`auto_pack_length`: 1.1 x p95 of the prefix-shared row lengths, rounded up to 128, never below the
longest row). Every standard sequence is shorter than its example's shared row, so it always fits.
With the same line length, per-line costs that do not depend on the documents (a dense attention
mask's L x L, mask construction) cost both packed modes the same per token, and the difference in the
number of lines is the token saving itself.

On CUDA (FlexAttention, compiled) the padded modes round their line length up to one of a few bucket
lengths (`bucket_length`) so the compiled kernel sees few shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixdpo.data.batch import Batch, bucket_length, build_batch, collate_lines
from prefixdpo.data.example import Example
from prefixdpo.data.grouping import group_by_prompt
from prefixdpo.data.tree import build_tree_batch, plan_tree_lines
from prefixdpo.data.layout import separate_rows
from prefixdpo.data.packing import auto_pack_length, plan_packs

__all__ = ["MODES", "GROUPED_MODE", "TRIE_MODE", "common_pack_length", "bucket_length", "layout_group", "standard_examples"]

MODES = ("paired", "paired-packed", "shared", "shared-packed")
GROUPED_MODE = "grouped-packed"
TRIE_MODE = "trie-packed"


def standard_examples(example: Example) -> list[Example]:
    """The records standard DPO trains on for `example`: one two-response Example per preference pair
    (response order (better, worse), pairs ((0, 1),)), as a TRL dataset holds a multi-response record
    split by its pairs. A two-response, one-pair example is returned unchanged."""
    if example.num_responses == 2 and len(example.pairs) == 1:
        return [example]
    return [Example(example.prompt_ids, (example.response_ids[i], example.response_ids[j]), ((0, 1),),
                    example.source_index, example.meta) for i, j in example.pairs]


def common_pack_length(examples: Sequence[Example], multiple: int = 128, grouped: Sequence[Example] = ()) -> int:
    """The pack length every packed mode uses: the paper's rule on the prefix-shared row lengths (of `examples`
    and, where the grouped mode runs, of their grouped rows, so those fit too)."""
    return auto_pack_length([ex.shared_length for ex in (*examples, *grouped)], multiple=multiple)


def layout_group(
    examples: Sequence[Example],
    mode: str,
    *,
    pack_length: int | None,
    pad_token_id: int = 0,
    bucketed: bool = False,
    line_multiple: int = 128,
) -> Batch:
    """Lay out one group of examples (one optimizer step) for `mode`.

    pack_length: line length of the packed modes (see `common_pack_length`); None = the whole group in
                 ONE line, padded to a multiple of `line_multiple` (the paper's layout: one packed line per
                 device batch; worth it only with an attention that skips masked blocks, segmented or flex).
    line_multiple: 128 for FlexAttention (its block size: the paper's padding); the CPU's segmented attention
                 needs none, and 128 would pad a short shared line by up to a tenth (8: SIMD-friendly rows).
    bucketed:    round padded line lengths up with `bucket_length` (CUDA/flex); else pad to the longest.
    The Batch's pairs are in example order in every mode, so per-pair results compare (the standard
    modes run `standard_examples`: their responses are the pairs' sides, two per pair), except in the grouped
    mode (pairs by prompt, in order of each prompt's first record).
    """
    if mode not in MODES + (GROUPED_MODE, TRIE_MODE):
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES + (GROUPED_MODE, TRIE_MODE))}")
    if mode == TRIE_MODE:
        if pack_length is None:
            return build_tree_batch(examples, pad_token_id=pad_token_id, pad_multiple=line_multiple)
        return build_tree_batch(examples, plan_tree_lines(examples, pack_length).lines, pad_token_id=pad_token_id,
                                length=pack_length)
    if mode == GROUPED_MODE:
        examples, mode = group_by_prompt(examples)[0], "shared-packed"
    if mode.startswith("paired"):
        examples = [std for ex in examples for std in standard_examples(ex)]
    if mode in ("paired", "shared"):
        sharing = mode == "shared"
        longest = max(ex.shared_length if sharing else len(ex.prompt_ids) + max(map(len, ex.response_ids))
                      for ex in examples)
        length = bucket_length(longest) if bucketed else None
        return build_batch(examples, prefix_sharing=sharing, pad_token_id=pad_token_id, length=length)
    if mode == "shared-packed":
        if pack_length is None:
            return build_batch(examples, prefix_sharing=True, packs=[list(range(len(examples)))],
                               pad_token_id=pad_token_id, pad_multiple=line_multiple)
        packs = plan_packs([ex.shared_length for ex in examples], pack_length, shuffle=False)
        return build_batch(examples, prefix_sharing=True, packs=packs, pad_token_id=pad_token_id, length=pack_length)
    # paired-packed: every [prompt][response] sequence is its own packing unit (and document).
    units = [(e, row) for e, ex in enumerate(examples) for row in separate_rows(ex)]
    if pack_length is None:
        return collate_lines(examples, [units], pad_token_id=pad_token_id, pad_multiple=line_multiple)
    packs = plan_packs([len(row) for _, row in units], pack_length, shuffle=False)
    lines = [[units[u] for u in pack] for pack in packs]
    return collate_lines(examples, lines, pad_token_id=pad_token_id, length=pack_length)
