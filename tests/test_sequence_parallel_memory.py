"""Per-rank activation memory under sequence parallelism (`tools.bench.sequence_parallel`): one long row (a
1,536-token prompt and two 256-token responses) through a policy pass and its backward, in one process and on 2
gloo ranks holding the row between them. The activations each rank keeps for backward (its own 1/N of the tokens
outside attention, 1/N of the heads inside) must be at most 0.6 x one process's; the whole line's mask, which every
rank holds, is counted apart. Both ranks' log-prob sums equal one process's (within K_FORWARD eps of their scale).
"""

from __future__ import annotations

import json
import os
import textwrap

from conftest import run_processes
from tolerances import K_FORWARD, assert_within

SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import finish_ranks, tiny_model
    from prefixdpo.core.sequence_parallel import new_sequence_parallel
    from prefixdpo_tools.bench.sequence_parallel import long_row, measure_row

    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    model = tiny_model("llama", hidden_size=128, intermediate_size=256, max_position_embeddings=4096)
    model.config._attn_implementation = "prefixdpo"
    sp = new_sequence_parallel(world)
    row = long_row(1536, (256, 256), vocab=96)
    result = {{b: measure_row(model, row, b, "cpu", sp).as_dict() for b in ("segmented", "sdpa")}}
    everyone = [None] * world
    if world > 1:
        torch.distributed.all_gather_object(everyone, result)
    else:
        everyone = [result]
    finish_ranks(rank, out_dir, everyone)
    """
)


def _run(tmp_path, nproc: int) -> list[dict]:
    script = tmp_path / "memory_script.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / f"np{nproc}"
    out.mkdir()
    run_processes(nproc, str(script), str(out))
    return json.loads((out / "result.json").read_text())


def test_each_rank_keeps_about_half_the_activations_of_one_process(tmp_path):
    (one,) = _run(tmp_path, 1)
    ranks = _run(tmp_path, 2)
    for backend in ("segmented", "sdpa"):
        _compare(one[backend], [rank[backend] for rank in ranks], backend)


def _compare(one: dict, ranks: list[dict], backend: str) -> None:
    scale = max(abs(s) for s in one["sums"])
    for r, rank in enumerate(ranks):
        assert_within(rank["sums"], one["sums"], scale, k=K_FORWARD, what=f"rank {r} sums")
        share = rank["saved_bytes"] / one["saved_bytes"]
        with_mask = (rank["saved_bytes"] + rank["mask_bytes"]) / (one["saved_bytes"] + one["mask_bytes"])
        peak = rank["peak_bytes"] / max(one["peak_bytes"], 1)
        print(f"REPORT sequence parallel memory ({backend}), rank {r} of 2 vs 1 process on a {one['tokens']}-token row: "
              f"activations kept for backward {rank['saved_bytes'] / 2**20:.1f} / {one['saved_bytes'] / 2**20:.1f} MiB"
              f" = {share:.3f}; with the whole-line mask (every rank holds it, "
              f"{one['mask_bytes'] / 2**20:.1f} MiB) {with_mask:.3f}; peak ({one['method']}) "
              f"{rank['peak_bytes'] / 2**20:.1f} / {one['peak_bytes'] / 2**20:.1f} MiB = {peak:.3f}")
        assert share <= 0.6, (r, share)
