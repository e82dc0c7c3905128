"""Decisions that could differ by rank are taken once (issue 17). One 2-rank gloo launch
(`drive_rank_decisions.py`) in which each rank has its own folders, as ranks on machines with their own disks:

- Reference cache, rank 0's folder full and rank 1's empty: both ranks hit (rank 0's table is broadcast; rank 1
  neither reads nor writes its folder). Rank 0's empty and rank 1's full: both miss and compute together, rank 0
  writes the table into its folder, rank 1's file is left as it was. Both runs finish and train as one process
  does (per-step metrics `tolerances.assert_same_dpo_log`, sampled weights within K eps x `weights_scale`, fp32
  SGD). Before the fix the first case left
  rank 1 in collectives rank 0 never joined (torchrun rc 1; a hang on NCCL).
- Embedded default, both ranks into one fresh folder: exactly one rank (0) builds, both then see the same
  complete files, equal to a one-process build, and no temporary folder is left. Each rank into its own folder
  (node-local disks): each builds its own, one after the other, both complete.
(A small `DemoSpec` keeps the builds short; the code path is the default's.)
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import run_processes, tiny_model
from tolerances import assert_same_dpo_log, assert_within, weights_scale

import drive_rank_decisions as driver
from prefixdpo_tools.demo import BUILD_FILE, build_demo

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    single = driver.cache_run(str(root / "single"), str(root / "full"))  # one process, fills `full`
    folders = {name: root / name for name in ("a_full", "b_empty", "c_empty", "d_full")}
    for name, folder in folders.items():
        shutil.copytree(root / "full", folder) if name.endswith("full") else folder.mkdir()
    d_before = driver.file_hashes(str(folders["d_full"]))
    out = root / "two"
    out.mkdir()
    shared, local = root / "shared" / "demo-base", [root / "node0" / "demo-base", root / "node1" / "demo-base"]
    run_processes(2, driver.__file__, str(out), f"demo:shared={shared},{shared}", f"demo:local={local[0]},{local[1]}",
                  f"cache:rank0_full={folders['a_full']},{folders['b_empty']}",
                  f"cache:rank1_full={folders['c_empty']},{folders['d_full']}", timeout=400)
    return dict(root=root, single=single, folders=folders, d_before=d_before, shared=shared, local=local,
                two=json.loads((out / "result.json").read_text()))


def _sums(folder):
    from safetensors.torch import load_file

    return [load_file(os.path.join(folder, name))["sums"] for name in sorted(os.listdir(folder))]


def test_ranks_with_different_cache_folders_take_one_decision_and_match_one_process(launched):
    single, two, folders = launched["single"], launched["two"], launched["folders"]
    assert not single["hit"] and len(os.listdir(launched["root"] / "full")) == 1
    assert [r["hit"] for r in two["rank0_full"]] == [True, True]
    assert os.listdir(folders["b_empty"]) == []  # rank 1 neither needed nor wrote its own folder
    assert [r["hit"] for r in two["rank1_full"]] == [False, False]
    assert driver.file_hashes(str(folders["d_full"])) == launched["d_before"]
    assert os.listdir(folders["c_empty"]) == os.listdir(launched["root"] / "full")  # rank 0 wrote this key's file
    (written,), (clean,) = _sums(folders["c_empty"]), _sums(launched["root"] / "full")
    assert ((written - clean).abs() <= 1e-6 * clean.abs().clamp(min=1)).all()  # computed over 2 ranks, same table
    params = torch.cat([p.detach().flatten() for p in tiny_model("llama").parameters()])
    start, end = params[:: max(1, params.numel() // 2000)], torch.tensor(single["params"])
    for case in ("rank0_full", "rank1_full"):
        for rank, result in enumerate(two[case]):
            assert len(result["logs"]) == len(single["logs"]) == 2, (case, rank)
            for a, b in zip(single["logs"], result["logs"]):
                assert_same_dpo_log(a, b, 0.5, METRICS, what=f"{case} rank {rank} step {a['step']}")
            assert_within(torch.tensor(result["params"]), end, weights_scale(start, end), what=f"{case} rank {rank}")


def test_embedded_default_is_built_once_per_filesystem(launched, tmp_path):
    two = launched["two"]
    reference = driver.file_hashes(str(build_demo(tmp_path / "one", driver.DEMO_SPEC).model_dir.parent))
    del reference[BUILD_FILE]  # the build id differs from build to build, the artifacts do not

    shared = two["shared"]
    assert [r["built"] for r in shared] == [1, 0]  # one builder for the folder both ranks share
    assert shared[0]["files"] == shared[1]["files"]  # both ranks read the same files ...
    assert {k: v for k, v in shared[0]["files"].items() if k != BUILD_FILE} == reference  # ... all of a whole build
    assert os.listdir(launched["shared"].parent) == ["demo-base"]  # no temporary folder left beside it

    local = two["local"]
    assert [r["built"] for r in local] == [1, 1]  # each rank's own disk got its own build
    for rank, result in enumerate(local):
        assert result["model_dir"] == str(launched["local"][rank] / "model")
        assert {k: v for k, v in result["files"].items() if k != BUILD_FILE} == reference
    assert local[0]["files"][BUILD_FILE] == local[1]["files"][BUILD_FILE]  # one build id for the run
