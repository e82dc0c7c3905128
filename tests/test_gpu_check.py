"""`make gpu-check` on CPU: one line and exit 0; its CPU-reachable pieces (plan, exactness checks on
sdpa, table, reports, exit status); the modules it imports never import `datasets` or TRL; the GRPO section's
checks on CPU, and its one-line skip where TRL is missing."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import cpu_half_dtype
from prefixdpo_tools import gpu_check
from prefixdpo_tools.gpu_check import dpo as gpu_check_dpo
from prefixdpo_tools.gpu_check.results import CheckResult

ROOT = Path(__file__).resolve().parents[1]


def test_make_gpu_check_without_cuda_prints_one_line_and_exits_0(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    proc = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={sys.executable}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [proc.stdout.strip()]
    assert proc.stdout.startswith("gpu-check: no CUDA device")
    assert not (tmp_path / "out").exists()  # nothing checked, nothing written


def test_plan_covers_every_arch_dtype_backend_and_profile():
    plan = gpu_check.planned_checks(["flex", "varlen", "sdpa"])
    verify = [n for s, n in plan if s == "verify"]
    assert len(verify) == 5 * 2 * 3 and "gemma2 bfloat16 varlen" in verify and "qwen3 float32 flex" in verify
    assert [n for s, n in plan if s == "train"] == ["llama float32 flex", "llama float32 varlen", "llama float32 sdpa",
                                                    gpu_check.QLORA_CHECK]
    bench = [n for s, n in plan if s == "bench"]
    assert len(bench) == 7 * 3 and "ultrafeedback-k4 varlen" in bench and "capybara sdpa" in bench
    # Without varlen in the install the plan simply lacks it; sections can be chosen.
    assert all("varlen" not in n for _, n in gpu_check.planned_checks(["flex", "sdpa"]))
    assert {s for s, _ in gpu_check.planned_checks(["flex"], sections=("train",))} == {"train"}
    # This install's backends, in the order checked: flex first, sdpa (the floor) last.
    backends = gpu_check.attention_backends()
    assert backends[0] == "flex" and backends[-1] == "sdpa"


def test_exactness_checks_pass_on_cpu_sdpa_and_report_unsupported_models():
    train = gpu_check.train_check("sdpa", "cpu")
    assert train.status == "ok", train.detail
    assert train.numbers["weight_moved"] > 1e-3 and train.numbers["loss_diff"] <= gpu_check.TRAIN_LOSS_TOL
    assert train.numbers["losses_paired"][0] == pytest.approx(0.6931472, abs=1e-6)  # step 1: policy == reference
    assert len(set(train.numbers["losses_paired"])) == gpu_check.TRAIN_STEPS  # later steps moved
    verify = gpu_check.verify_check("qwen2", "float32", "sdpa", "cpu")
    assert verify.status == "ok" and verify.numbers["logp"] <= 1e-5 and verify.numbers["grad"] > 0, verify.detail
    gemma = gpu_check.verify_check("gemma2", "float32", "sdpa", "cpu")
    assert gemma.status == "n/a" and "soft-capping" in gemma.detail


def test_qlora_step_is_skipped_in_one_line_without_bitsandbytes_and_checks_what_it_says(monkeypatch):
    """Without bitsandbytes (this machine): skipped, naming it. Its code path on CPU with the quantization config
    taken away (injected): everything trains, and the check fails because no weight is 4-bit."""
    import importlib.util

    from prefixdpo.dpo.config import DPOModelArguments

    if importlib.util.find_spec("bitsandbytes") is None:
        result = gpu_check.qlora_check("cpu")
        assert (result.status, result.detail) == ("skipped", "bitsandbytes not installed")
    monkeypatch.setattr(gpu_check_dpo, "QLORA_NEEDS", ("peft", "trl"))
    monkeypatch.setattr(DPOModelArguments, "quantization_config", lambda self: None)
    result = gpu_check.qlora_check("cpu", steps=2)
    assert result.status == "FAIL" and result.detail.startswith("0 4-bit weights on cpu"), result.detail
    assert result.numbers["adapters_moved"] > 0 and len(result.numbers["losses"]) == 2
    assert result.numbers["losses"][0] == pytest.approx(0.6931472, abs=1e-2)  # bf16 weights, fp32 compute
    assert gpu_check.exit_status([result]) == 1


def test_table_reports_and_exit_status(tmp_path):
    results = [
        CheckResult("verify", "llama float32 flex", "ok", "rel dlogp 1e-07"),
        CheckResult("verify", "gemma2 float32 sdpa", "n/a", "soft-capping"),
        CheckResult("bench", "hh-rlhf flex", "error", "RuntimeError: a | b"),
        CheckResult("bench", "tldr sdpa", "skipped", "time budget spent", {"x": 1}),
    ]
    table = gpu_check.format_table(results).splitlines()
    assert table[0].split() == ["section", "check", "status", "detail"] and set(table[1]) == {"-"}
    assert len(table) == 2 + len(results) and table[2].index("ok") == table[0].index("status")
    # Bench errors and skips never fail the run; a verify or train failure or error does.
    assert gpu_check.exit_status(results) == 0
    assert gpu_check.exit_status(results + [CheckResult("train", "llama float32 flex", "error", "boom")]) == 1
    assert gpu_check.exit_status(results + [CheckResult("verify", "qwen2 bfloat16 sdpa", "FAIL", "")]) == 1

    paths = gpu_check.write_reports(results, {"device": "test"}, tmp_path / "o")
    assert [p.name for p in paths] == ["gpu-check.json", "gpu-check.md"]
    data = json.loads(paths[0].read_text())
    assert data["meta"] == {"device": "test"} and data["results"][3]["numbers"] == {"x": 1}
    assert data["verdict"] == "all exactness checks passed"
    md = paths[1].read_text()
    assert "## verify" in md and "## bench" in md and "## train" not in md
    assert "| hh-rlhf flex | error | RuntimeError: a / b |" in md  # a '|' in a detail cannot break the table


def test_package_imports_without_datasets_or_trl():
    """The GPU machine has neither `datasets` nor TRL: what gpu-check, verify and bench import must not
    need them at module level (a finder that refuses them stands in for their absence)."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('datasets', 'trl'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import prefixdpo_tools.gpu_check, prefixdpo.core.verify, prefixdpo_tools.bench.runner\n"
        "import prefixdpo_tools.bench.step, prefixdpo_tools.bench.model, prefixdpo_tools.bench.workloads\n"
        "import prefixdpo.commands.verify, prefixdpo.cli\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_trainer_imports_and_trains_where_trl_and_datasets_are_absent():
    """As on the GPU machine: `datasets` and TRL cannot be found at all (the path finder reports them
    missing), yet the trainer imports and runs a step on Examples; only option parsing needs TRL."""
    code = (
        "import sys, importlib.machinery as m\n"
        "find = m.PathFinder.find_spec\n"
        "def hidden(cls, name, path=None, target=None):\n"
        "    return None if name.split('.')[0] in ('datasets', 'trl') else find(name, path, target)\n"
        "m.PathFinder.find_spec = classmethod(hidden)\n"
        "sys.path.insert(0, 'tests')\n"
        "from conftest import make_examples, tiny_model\n"
        "from prefixdpo.dpo.config import PrefixDPOConfig\n"
        "from prefixdpo.dpo.trainer import PrefixDPOTrainer\n"
        "assert 'trl' not in sys.modules and 'datasets' not in sys.modules\n"
        "args = PrefixDPOConfig(output_dir='/tmp/no-trl', max_steps=1, use_cpu=True, report_to='none',\n"
        "                       save_strategy='no', disable_tqdm=True, gradient_checkpointing=False)\n"
        "PrefixDPOTrainer(model=tiny_model('llama'), args=args, train_dataset=make_examples(4)).train()\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# ---- the GRPO section


def test_grpo_plan_and_names_match_the_grpo_package():
    from prefixdpo_tools.bench.grpo import PROFILES
    from prefixdpo_tools.gpu_check.grpo import VERIFY_ARCHS

    assert gpu_check.GRPO_PROFILES == tuple(PROFILES) and gpu_check.GRPO_ARCHS == VERIFY_ARCHS
    plan = gpu_check.planned_checks(["flex", "varlen", "sdpa"], sections=("grpo",))
    verify = [n for s, n in plan if s == "grpo verify"]
    bench = [n for s, n in plan if s == "grpo bench"]
    assert len(verify) == 2 * 2 * 3 and "qwen2 bfloat16 varlen" in verify
    assert len(bench) == 3 * 3 + 1 and "long-context flex" in bench and bench[-1] == "whole step math-like"
    assert "grpo" in gpu_check.SECTIONS  # a plain `make gpu-check` runs it


def test_grpo_section_runs_its_checks_on_cpu(monkeypatch):
    """The section's real code on CPU sdpa: exactness against TRL's pass (fp32 and bf16, or fp16 where this CPU
    cannot attend in bf16: `conftest.cpu_half_dtype`), a tiny bench of every profile, the whole step."""
    from prefixdpo_tools.bench.model import SHAPES

    torch.set_num_threads(1)  # conftest restores it
    dtypes = ("float32", str(cpu_half_dtype()).removeprefix("torch."))  # bfloat16 where this CPU attends in it
    # the section's module (the package exports its `main` function under the same name)
    monkeypatch.setattr(importlib.import_module("prefixdpo_tools.gpu_check.main"), "DTYPES", dtypes)
    lines = []
    results = gpu_check.grpo_section(["sdpa"], "cpu", time.monotonic() + 300, shape=SHAPES["quick"],
                                     length_scale=0.05, rollouts=1, repeats=1, warmup=0, log=lines.append)
    verify = [r for r in results if r.section == "grpo verify"]
    assert [r.name for r in verify] == [f"{a} {d} sdpa" for a in gpu_check.GRPO_ARCHS for d in dtypes]
    assert all(r.status == "ok" for r in verify), [r.detail for r in verify]
    fp32 = [r for r in verify if "float32" in r.name]
    assert all(r.numbers["logp"] <= 1e-5 and 0 < r.numbers["grad"] <= 1e-4 for r in fp32)
    bench = [r for r in results if r.section == "grpo bench"]
    assert [r.name for r in bench] == [f"{p} sdpa" for p in gpu_check.GRPO_PROFILES] + ["whole step math-like"]
    assert all(r.status == "ok" for r in bench), [r.detail for r in bench]
    assert all(r.numbers["ideal"] > 1 and r.numbers["speedups"]["shared_packed_vs_trl"] > 0 for r in bench[:-1])
    assert 0 < bench[-1].numbers["share_trl"] < 1 and bench[-1].numbers["speedup"] > 0
    assert len(lines) == len(results) and gpu_check.exit_status(results) == 0


def test_grpo_section_without_trl_is_one_line_and_one_skipped_check():
    """As on a GPU machine without TRL: the finder reports trl and datasets missing."""
    code = (
        "import sys, time, importlib.machinery as m\n"
        "find = m.PathFinder.find_spec\n"
        "def hidden(cls, name, path=None, target=None):\n"
        "    return None if name.split('.')[0] in ('datasets', 'trl') else find(name, path, target)\n"
        "m.PathFinder.find_spec = classmethod(hidden)\n"
        "from prefixdpo_tools import gpu_check\n"
        "results = gpu_check.grpo_section(['sdpa'], 'cpu', time.monotonic() + 60)\n"
        "assert 'trl' not in sys.modules\n"
        "print([(r.section, r.name, r.status) for r in results], gpu_check.exit_status(results))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.strip().splitlines()
    assert out[0] == ("grpo: skipped: trl and datasets not installed for this python (the GRPO checks compare "
                      "against TRL's GRPOTrainer)")
    assert out[1:] == ["[('grpo verify', 'all', 'skipped')] 0"]


def test_grpo_verify_fails_the_run_and_grpo_bench_does_not(tmp_path):
    ok = [CheckResult("grpo bench", "math-like flex", "error", "boom")]
    assert gpu_check.exit_status(ok) == 0
    bad = ok + [CheckResult("grpo verify", "llama float32 flex", "FAIL", "rel dlogp 1e-2")]
    assert gpu_check.exit_status(bad) == 1 and gpu_check.verdict(bad).startswith("FAIL: 1")
    md = gpu_check.write_reports(bad, {"device": "test"}, tmp_path)[1].read_text()
    assert md.index("## grpo verify") < md.index("## grpo bench")


def test_sequence_parallel_section_checks_head_shards_and_says_when_it_needs_two_devices():
    from prefixdpo_tools.gpu_check import sequence_parallel

    assert "sp" in gpu_check.SECTIONS
    plan = gpu_check.planned_checks(["flex", "sdpa"], sections=("sp",))
    assert plan == [("sequence parallel", "heads flex"), ("sequence parallel", "heads sdpa"),
                    ("sequence parallel", "2 ranks flex")]
    lines = []
    results = sequence_parallel.section(["sdpa", "segmented"], "cpu", log=lines.append)
    assert [r.status for r in results[:2]] == ["ok", "ok"], [r.detail for r in results]
    assert results[0].numbers["max_diff"] <= results[0].numbers["bound"]
    assert results[2].status == "n/a" and "needs 2 CUDA devices" in results[2].detail  # a CPU machine: 0 devices
    assert len(lines) == 3


def test_the_prefix_reuse_section_compares_reused_passes_with_one_row(monkeypatch):
    """The reuse check runs on CPU backends too (on CUDA it is flex's and varlen's only run over external keys): it
    passes on the real code, and fails when a reused pass's hidden states are off by 1e-2."""
    from prefixdpo.core import prefix_reuse
    from prefixdpo_tools.gpu_check import prefix_reuse as reuse_section

    assert ("prefix reuse", "reuse llama flex") in gpu_check.planned_checks(["flex", "sdpa"], sections=("reuse",))
    result = reuse_section.reuse_check("llama", "segmented", "cpu")
    assert result.status == "ok", result.detail
    assert all(n >= 3 for n in result.numbers["chunks"])
    run = prefix_reuse._run  # each pass of a reused line
    monkeypatch.setattr(prefix_reuse, "_run", lambda *args: run(*args) + 1e-2)
    assert reuse_section.reuse_check("llama", "segmented", "cpu").status == "FAIL"


def test_the_hybrid_section_checks_recurrent_layers_on_shared_lines(monkeypatch):
    """gpu-check's hybrid section, run on CPU here (one family, fp32, sdpa): verify's cases on spans longer than the
    layers' chunks, ok; a family this transformers lacks is n/a, not an error."""
    from prefixdpo_tools.gpu_check import hybrid

    monkeypatch.setattr(hybrid, "FAMILIES", ("lfm2", "no_such_family"))
    monkeypatch.setattr(hybrid, "DTYPES", ("float32",))
    lines = []
    results = hybrid.section(["sdpa"], "cpu", log=lines.append)
    assert lines[0].startswith("hybrid: kernels ")
    assert [(r.name, r.status) for r in results] == [("lfm2 float32 sdpa", "ok"),
                                                     ("no_such_family float32 sdpa", "n/a")]
    assert results[0].numbers["logp"] < 1e-5 and results[0].numbers["grad"] < 1e-4
