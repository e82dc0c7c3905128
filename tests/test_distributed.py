"""2-process DDP over gloo on CPU (torchrun): same per-step losses and final weights as one process
with the same global batch, and no hang when the data does not split evenly over the ranks (7
examples over 2 ranks unpacked: rank 1 runs an empty slot; 5 packed examples: a zero-weight batch).
Tolerance: loss 1e-5 relative, weights 1e-5 absolute (fp32, SGD)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import make_examples, tiny_model
    from prefixdpo.config import PrefixDPOConfig
    from prefixdpo.trainer import PrefixDPOTrainer

    out_dir, batch = sys.argv[1], int(sys.argv[2])
    results = {{}}
    for name, n, extra in (("unpacked", 7, {{}}), ("packed", 5, {{"packing": True, "pack_length": 64}})):
        args = PrefixDPOConfig(
            output_dir=os.path.join(out_dir, name), per_device_train_batch_size=batch if name == "unpacked" else 1,
            max_steps=-1, num_train_epochs=2, logging_steps=1, learning_rate=0.5, optim="sgd",
            lr_scheduler_type="constant", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, beta=0.5,
            report_to="none", ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None, **extra)
        t = PrefixDPOTrainer(model=tiny_model("llama"), args=args, train_dataset=make_examples(n, ks=(2, 3)))
        t.train()
        params = torch.cat([p.detach().flatten() for p in t.model.parameters()])
        results[name] = {{"loss": [h["loss"] for h in t.state.log_history if "loss" in h],
                          "acc": [h["rewards/accuracies"] for h in t.state.log_history if "loss" in h],
                          "params": params[:: max(1, params.numel() // 2000)].tolist()}}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as fh:
            json.dump(results, fh)
    """
)


def _run(tmp_path, nproc: int, batch: int) -> dict:
    script = tmp_path / "ddp_script.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(SCRIPT.format(tests=tests))
    out = tmp_path / f"np{nproc}"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if nproc == 1:
        cmd = [sys.executable, str(script), str(out), str(batch)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               "29517", str(script), str(out), str(batch)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def test_two_process_ddp_matches_one_process(tmp_path):
    one = _run(tmp_path, 1, 4)  # global batch 4 in one process
    two = _run(tmp_path, 2, 2)  # 2 ranks x 2
    u1, u2 = one["unpacked"], two["unpacked"]
    assert len(u1["loss"]) == len(u2["loss"]) == 4  # 2 steps per epoch (4 + 3 examples), 2 epochs
    assert u2["loss"] == pytest.approx(u1["loss"], rel=1e-5)
    assert u2["acc"] == u1["acc"]
    assert max(abs(a - b) for a, b in zip(u1["params"], u2["params"])) < 1e-5
    # packed, uneven: it finished on both ranks (no hang) and learned something finite
    p2 = two["packed"]
    assert p2["loss"] and all(l == l for l in p2["loss"])
