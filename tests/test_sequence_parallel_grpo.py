"""GRPO and RLOO with sequence parallelism: 2 gloo ranks, each line of every log-prob pass (policy, old policy, reference)
held by both (`sequence_parallel_size=2`), against one process with the same global batch.

TRL deals different prompts to the two ranks; the group runs each rank's rows in turn, both together
(`passes.GroupPasses.group_passes`). The rollouts come from test_grpo_distributed's seeded `rollout_func`, so the
completions do not depend on the world size. Asserted over 4 SGD steps as there: every metric within
`metric_within` of its scale (packing/efficiency apart: each rank packs its own groups), sampled final weights within
K eps x `weights_scale`.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import run_processes
from test_grpo_distributed import SCRIPT, _same_training

ONE_OR_SP = SCRIPT[SCRIPT.index("\nif world > 1:"):SCRIPT.index("\nfinish_ranks(")]
SP_SCRIPT = SCRIPT.replace(ONE_OR_SP, """
if world > 1:
    results = {{"sp": run("sp", 4, sequence_parallel_size=2)}}
else:
    results = {{"one": run("one", 8)}}""")


# RLOO: TRL's RLOO trainer takes no rollout_func, so each rank samples with its own seed: 2 sequence-parallel ranks
# against 2 DDP ranks, which sample the same completions (the run sequence parallelism must reproduce)
RLOO_SCRIPT = (SCRIPT.replace("PrefixGRPOConfig", "PrefixRLOOConfig").replace("PrefixGRPOTrainer", "PrefixRLOOTrainer")
               .replace(', loss_type="dapo"', "").replace("rollout_func=rollout, ", "")
               .replace(ONE_OR_SP, """
results = {{"run": run("run", 4, sequence_parallel_size=int(sys.argv[3]))}}"""))


def _run(tmp_path, script_text: str, runs: dict[str, tuple[int, list[str]]]) -> dict:
    """Each run's results: `runs` names a run by its (processes, extra script arguments); one saved tiny model."""
    from grpo_common import saved_tiny_model

    model_dir = saved_tiny_model(tmp_path / "model")
    script = tmp_path / "script.py"
    script.write_text(script_text.format(tests=os.path.dirname(os.path.abspath(__file__))))
    results = {}
    for name, (nproc, extra) in runs.items():
        out = tmp_path / name
        out.mkdir()
        run_processes(nproc, str(script), str(out), model_dir, *extra)
        results[name] = json.loads((out / "result.json").read_text())
    return results


def test_rloo_on_two_sequence_parallel_ranks_equals_two_ddp_ranks(tmp_path):
    for piece in (', loss_type="dapo"', "rollout_func=rollout, "):
        assert piece in SCRIPT  # what the RLOO script drops
    results = _run(tmp_path, RLOO_SCRIPT, {"sp1": (2, ["1"]), "sp2": (2, ["2"])})
    worst = _same_training(results["sp1"]["run"], results["sp2"]["run"])
    print(f"REPORT rloo sequence parallel 2 ranks vs 2 DDP ranks: worst metric difference {worst:.2f} eps x its scale")


def test_grpo_on_two_sequence_parallel_ranks_equals_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16
    results = _run(tmp_path, SP_SCRIPT, {"np1": (1, []), "np2": (2, [])})
    worst = _same_training(results["np1"]["one"], results["np2"]["sp"])
    print(f"REPORT grpo sequence parallel 2 ranks vs 1 process: worst metric difference {worst:.2f} eps x its scale")


@pytest.mark.parametrize("config", ["PrefixGRPOConfig", "PrefixRLOOConfig"])
def test_grpo_options_refused_with_sequence_parallelism(config):
    import prefixdpo.grpo as grpo
    from prefixdpo.errors import ConfigError

    base = dict(output_dir="unused", use_cpu=True, report_to="none", sequence_parallel_size=2)
    with pytest.raises(ConfigError, match="runs the prefix-shared passes: set prefix_sharing true"):
        getattr(grpo, config)(prefix_sharing=False, **base)
    with pytest.raises(ConfigError, match="prefix_reuse=true is not supported"):
        getattr(grpo, config)(prefix_reuse=True, **base)
