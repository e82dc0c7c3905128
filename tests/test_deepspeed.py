"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU (DeepSpeed's CPU accelerator, 2 gloo ranks via torchrun) against one
plain process with the same global batch.

1. Training: per-step losses and metrics (`tolerances.assert_same_dpo_log`) and final weights (K eps x
   `weights_scale`; fp32, SGD) equal one process, with prefix sharing on, unpacked (10 examples, 3 steps, the
   last one uneven) and packed. The reference is the frozen starting policy, as users get it by default.
2. ZeRO-3 really partitioned: the policy is loaded the way users load it (`from_pretrained` after the
   DeepSpeed config exists, so under `zero.Init`), every policy parameter keeps only its partition on the
   rank, and the reference model is a ZeRO-3 engine with partitioned parameters too (not a full copy per
   rank). ZeRO-2 keeps whole parameters.
3. `reference_deepspeed_config` (TRL's rules for the reference engine's config) without DeepSpeed.

DeepSpeed's shared-memory all-reduce op (serving its inference all-reduce only) is not JIT-built here:
`conftest._NoDeepSpeedShmBuild` says why training computes the same without it.
"""

from __future__ import annotations

import importlib.util
import textwrap
from types import SimpleNamespace

import pytest
import torch
from conftest import run_rank_script, tiny_model

from prefixdpo.core.engines_deepspeed import reference_deepspeed_config
from tolerances import assert_same_dpo_log, assert_within, weights_scale

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
from prefixdpo.errors import ConfigError

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install deepspeed)")

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import make_examples, finish_ranks, rank_script_start

    out_dir, engine, world, rank, init = rank_script_start(sys.argv)

    import gc
    from transformers import AutoModelForCausalLM
    from prefixdpo import PrefixDPOConfig
    from prefixdpo.core.engines_deepspeed import zero3_partition_counts
    from prefixdpo.core.model_checks import unwrap
    from prefixdpo import PrefixDPOTrainer

    gc.freeze()  # Trainer.train runs gc.collect(); what is imported so far need not be scanned each time
    ds = None
    if engine != "none":
        zero = {{"stage": int(engine[-1])}}
        if zero["stage"] == 3:
            # partition every parameter of the tiny model (the default keeps params under 1e5 elements whole);
            # the bucket sizes stay "auto", filled from the hidden size for the policy and the reference
            zero.update(stage3_param_persistence_threshold=0, reduce_bucket_size="auto",
                        stage3_prefetch_bucket_size="auto")
        ds = {{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
               "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "zero_optimization": zero}}

    def full_params(model):
        params = list(model.parameters())
        if hasattr(params[0], "ds_id"):
            import deepspeed
            with deepspeed.zero.GatheredParameters(params):
                return torch.cat([p.detach().flatten() for p in params]).tolist()
        return torch.cat([p.detach().flatten() for p in params]).tolist()

    results = {{}}
    # global batch: 4 examples unpacked, 2 packed lines (so the packed run takes more than one step too)
    for name, batch, extra in (("unpacked", 4, {{}}), ("packed", 2, {{"packing": True, "pack_length": 64}})):
        args = PrefixDPOConfig(output_dir=os.path.join(out_dir, name), logging_steps=1, learning_rate=0.5,
                               optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                               disable_tqdm=True, seed=0, beta=0.5, report_to="none",
                               ddp_backend="gloo" if world > 1 else None, per_device_train_batch_size=batch // world,
                               num_train_epochs=1, gradient_checkpointing=False, deepspeed=ds, **extra)
        # loaded after the DeepSpeed config exists: under ZeRO-3, transformers loads it partitioned (zero.Init)
        model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
        t = PrefixDPOTrainer(model=model, train_dataset=make_examples(10, ks=(2, 3)), args=args)
        t.train()
        logs = [h for h in t.state.log_history if "loss" in h]
        policy = unwrap(t.model_wrapped)
        results[name] = {{
            "engine": type(t.model_wrapped).__name__, "ref_engine": type(t.ref_model).__name__,
            "logs": logs, "params": full_params(policy),
            "policy_partitioned": zero3_partition_counts(policy),
            "policy_local_numel": sum(p.numel() for p in policy.parameters()),
            "ref_partitioned": zero3_partition_counts(unwrap(t.ref_model)),
        }}
    finish_ranks(rank, out_dir, results)
    """
)


def _run(tmp_path, engine: str) -> dict:
    return run_rank_script(tmp_path, SCRIPT, engine)


@needs_deepspeed
def test_zero2_and_zero3_on_two_ranks_match_one_process(tmp_path):
    one = _run(tmp_path, "none")
    runs = {"zero2": _run(tmp_path, "zero2"), "zero3": _run(tmp_path, "zero3")}
    total = len(one["unpacked"]["params"])
    start = torch.cat([p.detach().flatten() for p in tiny_model("llama").parameters()])  # the saved `init`
    for engine, result in runs.items():
        for layout in ("unpacked", "packed"):
            base, got = one[layout], result[layout]
            assert got["engine"] == "DeepSpeedEngine" and got["ref_engine"] == "DeepSpeedEngine", (engine, layout)
            assert len(base["logs"]) == len(got["logs"]) >= 2, (engine, layout)
            for a, b in zip(base["logs"], got["logs"]):
                assert_same_dpo_log(a, b, 0.5, METRICS, what=f"{engine} {layout} step {a['step']}")
            end = torch.tensor(base["params"])
            assert_within(torch.tensor(got["params"]), end, weights_scale(start, end), what=f"{engine} {layout}")
    assert len(one["unpacked"]["logs"]) == 3  # 10 examples, global batch 4: 4 + 4 + 2 (the last step uneven)
    for layout in ("unpacked", "packed"):
        z2, z3 = runs["zero2"][layout], runs["zero3"][layout]
        n_params = z3["policy_partitioned"][1]
        # ZeRO-3: every policy parameter holds only its partition here, and the reference is partitioned too
        assert z3["policy_partitioned"] == [n_params, n_params], layout
        assert z3["policy_local_numel"] == 0, layout  # released outside the forward: nothing whole on the rank
        assert z3["ref_partitioned"] == [n_params, n_params], layout
        # ZeRO-2 partitions gradients and optimizer state only: whole parameters, a whole reference (stage 0)
        assert z2["policy_partitioned"][0] == 0 and z2["ref_partitioned"][0] == 0, layout
        assert z2["policy_local_numel"] == total, layout


def _plugin_config(stage: int, **zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}},
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}, **zero}}


def test_reference_config_follows_trl_rules_and_fills_autos_as_transformers_does():
    model_config = SimpleNamespace(hidden_size=32)
    policy = _plugin_config(3, reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
                            stage3_param_persistence_threshold=7)
    ref = reference_deepspeed_config(policy, model_config)
    assert "optimizer" not in ref and "scheduler" not in ref and "offload_optimizer" not in ref["zero_optimization"]
    assert "train_batch_size" not in ref and ref["train_micro_batch_size_per_gpu"] == 2  # DeepSpeed derives it
    zero = ref["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["reduce_bucket_size"] == 32 * 32  # transformers' rules for "auto"
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    assert zero["stage3_param_persistence_threshold"] == 7  # the user's value stays
    assert policy["zero_optimization"]["reduce_bucket_size"] == "auto" and "optimizer" in policy  # not mutated
    assert "reduce_bucket_size" not in reference_deepspeed_config(_plugin_config(3), model_config)["zero_optimization"]
    for stage in (0, 1, 2):  # nothing to partition without gradients or optimizer state: a whole copy
        ref = reference_deepspeed_config(_plugin_config(stage, reduce_bucket_size="auto"), model_config)
        assert ref["zero_optimization"]["stage"] == 0 and ref["zero_optimization"]["reduce_bucket_size"] == 1024
    vision = SimpleNamespace(text_config=SimpleNamespace(hidden_sizes=[8, 16]))
    ref = reference_deepspeed_config(_plugin_config(3, reduce_bucket_size="auto"), vision)
    assert ref["zero_optimization"]["reduce_bucket_size"] == 256


def test_reference_config_refuses_an_auto_it_cannot_fill():
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size .*hidden_size"):
        reference_deepspeed_config(_plugin_config(2, reduce_bucket_size="auto"), SimpleNamespace())
