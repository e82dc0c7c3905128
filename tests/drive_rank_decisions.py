"""Driver of test_rank_decisions: each rank with its own folders, as ranks on machines with their own disks.

    python drive_rank_decisions.py OUT KIND:NAME=DIR_RANK0,DIR_RANK1 ...

KIND `cache`: one short DPO training with a precomputed reference and `ref_cache_dir` = this rank's DIR;
KIND `demo`: `build_demo_for_run` into this rank's DIR (a small `DEMO_SPEC`), recording which ranks built.
Rank 0 writes OUT/result.json: {NAME: [one result per rank]}.
"""

import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import finish_ranks, make_examples, tiny_model  # noqa: E402

import prefixdpo_tools.demo as demo  # noqa: E402
from prefixdpo.dpo.config import PrefixDPOConfig  # noqa: E402
from prefixdpo.core.rank_decisions import gather  # noqa: E402
from prefixdpo.dpo.trainer import PrefixDPOTrainer  # noqa: E402

DEMO_SPEC = demo.DemoSpec(num_train=60, num_eval=10, vocab_size=300, hidden_size=32, intermediate_size=64)


def world_and_rank() -> tuple[int, int]:
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def config(out: str, **kw) -> PrefixDPOConfig:
    world, _ = world_and_rank()
    base = dict(output_dir=out, per_device_train_batch_size=4 // world, max_steps=2, logging_steps=1,
                learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                disable_tqdm=True, seed=0, beta=0.5, report_to="none", ddp_backend="gloo" if world > 1 else None,
                gradient_checkpointing=False)
    return PrefixDPOConfig(**{**base, **kw})


def cache_run(out: str, cache_dir: str) -> dict:
    """2 SGD steps of DPO over 8 examples (global batch 4) with the reference precomputed into `cache_dir`."""
    args = config(out, precompute_ref_log_probs=True, ref_cache_dir=cache_dir)
    trainer = PrefixDPOTrainer(model=tiny_model("llama"), args=args, train_dataset=make_examples(8))
    trainer.train()
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return {"hit": trainer.reference.cache_hits["train"],
            "logs": [h for h in trainer.state.log_history if "loss" in h],
            "params": params[:: max(1, params.numel() // 2000)].tolist()}


def file_hashes(folder: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def demo_run(out: str, folder: str) -> dict:
    """`build_demo_for_run` into `folder`: did this rank build, and the files it then sees."""
    built = []
    real = demo.build_demo

    def counted(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    demo.build_demo = counted
    try:
        paths = demo.build_demo_for_run(folder, config(out), spec=DEMO_SPEC)
    finally:
        demo.build_demo = real
    return {"built": len(built), "model_dir": str(paths.model_dir), "files": file_hashes(folder)}


def main() -> None:
    world, rank = world_and_rank()
    out, results = sys.argv[1], {}
    for spec in sys.argv[2:]:
        kind, rest = spec.split(":", 1)
        name, dirs = rest.split("=", 1)
        run = {"cache": cache_run, "demo": demo_run}[kind]
        results[name] = gather(run(os.path.join(out, f"{name}-rank{rank}"), dirs.split(",")[rank]))
    finish_ranks(rank, out, results)


if __name__ == "__main__":
    main()
