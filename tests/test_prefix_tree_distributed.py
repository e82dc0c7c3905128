"""`prefix_tree=true` over several processes: 2 gloo ranks (DDP), FSDP2 and DeepSpeed ZeRO-3 against one process
with the same global batch, on CPU (torchrun).

The data: K = 3 and 4 response records behind one system prompt (two records per prompt) and two 3-turn dialogues,
packed into 5 lines of tries of at most 48 tokens (2 subtrees cut across lines); a global batch of 2 lines makes 3
optimizer steps, the last one uneven (one line: the second rank runs a zero-weight micro-batch). Lines are whole on
one rank (the loader deals lines), so each step holds the same pairs in the same tries whatever the world size.

Asserted, per case, against the one-process run: every logged step's loss and metrics (rewards, log-probs, tokens
saved, packing efficiency; `tolerances.assert_same_dpo_log`; not the accuracies, which a tie could flip) and the
final trainable weights (within K eps x `weights_scale`; fp32, SGD). Cases: a separate reference model; LoRA
(adapter-off reference); a precomputed reference table; with gradient accumulation in one process (1 line x 2 micro-batches); FSDP2 with the
same three, each asserting every parameter was a DTensor sharded over the 2 ranks; ZeRO-3 with the default reference
(a ZeRO-3 engine of the frozen start) and with a separate one, asserting the policy was partitioned (ZeRO-3 refuses
precomputed tables, `engines.refuse_unsupported_engine_options`). Three launches (1 process; 2 processes DDP +
FSDP2; 2 processes ZeRO-3), about 2 minutes on 2 CPU cores (6 when other jobs load them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import textwrap

import pytest
import torch
from conftest import run_processes, tiny_model
from tolerances import assert_same_dpo_log, assert_within, weights_scale

BETA = 0.5

SCRIPT = textwrap.dedent(
    """
    import contextlib, os, sys
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import FSDP2 as FSDP, ZERO3, finish_ranks
    from test_prefix_tree_training import k_response_records
    from test_tree import dialogue
    import random
    from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer
    from prefixdpo.core.model_checks import unwrap

    import gc
    gc.freeze()  # Trainer.train runs gc.collect(); what is imported so far need not be scanned each time
    out_dir, engine, init = sys.argv[1], sys.argv[2], sys.argv[3]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    examples = k_response_records(prompts=3) + dialogue(random.Random(1), 3) + dialogue(random.Random(2), 3)

    def lora():
        from peft import LoraConfig
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=False)

    def weights(model):
        # every trainable parameter whole (an FSDP2 DTensor's full tensor, a ZeRO-3 parameter gathered), subsampled
        params = [p for p in unwrap(model).parameters() if p.requires_grad]
        if hasattr(params[0], "ds_id"):
            import deepspeed
            with deepspeed.zero.GatheredParameters(params):
                flat = torch.cat([p.detach().flatten() for p in params])
        else:
            flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
                              for p in params])
        return flat[:: max(1, flat.numel() // 3000)].tolist()

    def run(name, ref="scaled", peft=False, lines=2, **kw):
        args = PrefixDPOConfig(output_dir=os.path.join(out_dir, name), logging_steps=1, learning_rate=0.5,
                               optim="sgd", lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                               disable_tqdm=True, seed=0, beta=0.5, report_to="none",
                               ddp_backend="gloo" if world > 1 else None, gradient_checkpointing=False,
                               num_train_epochs=1, per_device_train_batch_size=lines // world, packing=True,
                               pack_length=48, prefix_tree=True, **kw)
        # loaded after the config exists: under ZeRO-3 transformers loads it partitioned (zero.Init)
        from transformers import AutoModelForCausalLM
        policy = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
        reference = None
        if ref == "scaled":  # a reference that is not the policy
            reference = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
            params = list(reference.parameters())
            whole = contextlib.nullcontext()
            if hasattr(params[0], "ds_id"):  # loaded partitioned (ZeRO-3): scale the whole parameters
                import deepspeed
                whole = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
            with whole, torch.no_grad():
                for p in params:
                    p.mul_(0.9)
        t = PrefixDPOTrainer(model=policy, ref_model=reference, peft_config=lora() if peft else None, args=args,
                             train_dataset=examples)
        initial = weights(t.model_wrapped)
        t.train()
        from prefixdpo.core.engines_deepspeed import zero3_partition_counts
        return {{"logs": [h for h in t.state.log_history if "loss" in h], "weights": weights(t.model_wrapped),
                 "initial": initial,
                 "engine": t.engine_description, "lines": len(t._train_micro.tree_plan.lines),
                 "partitioned": list(zero3_partition_counts(unwrap(t.model_wrapped)))}}

    PRECOMPUTED = dict(precompute_ref_log_probs=True, ref_cache_dir=os.path.join(out_dir, "cache"))
    cases = {{"ref": {{}}, "lora": dict(ref=None, peft=True), "precomputed": PRECOMPUTED, "default-ref": dict(ref=None)}}
    if engine == "none":
        cases["accumulated"] = dict(lines=1, gradient_accumulation_steps=2)
    elif engine == "ddp":
        cases = {{**{{f"ddp-{{k}}": cases[k] for k in ("ref", "lora", "precomputed")}},
                  **{{f"fsdp-{{k}}": dict(cases[k], **FSDP) for k in ("ref", "lora", "precomputed")}}}}
    else:  # zero3
        cases = {{f"zero3-{{k}}": dict(cases[k], deepspeed=ZERO3) for k in ("default-ref", "ref")}}
    results = {{name: run(name, **kw) for name, kw in cases.items()}}
    finish_ranks(rank, out_dir, results)
    """
)

# logged per step and independent of the world size (not throughput, not the accuracies: a tie could flip one)
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
            "prefix_sharing/tokens_saved", "packing/efficiency")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: result} of the three launches (the one-process cases under their own names)."""
    tmp = tmp_path_factory.mktemp("tree")
    script = tmp / "tree_script.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    tiny_model("llama").save_pretrained(str(tmp / "init"))
    results = {}
    for nproc, engine in ((1, "none"), (2, "ddp"), (2, "zero3")):
        if engine == "zero3" and importlib.util.find_spec("deepspeed") is None:
            continue
        out = tmp / engine
        out.mkdir()
        run_processes(nproc, str(script), str(out), engine, str(tmp / "init"))
        results.update(json.loads((out / "result.json").read_text()))
    return results


def _same_training(one: dict, other: dict) -> tuple[float, float]:
    """Asserts `other` trained as `one` did; returns (worst metric, worst weight difference), in eps x scale."""
    assert one["lines"] == other["lines"] == 5
    assert len(one["logs"]) == len(other["logs"]) == 3  # 2 + 2 + 1 lines
    worst_metric = 0.0
    for a, b in zip(one["logs"], other["logs"]):
        worst_metric = max(worst_metric, assert_same_dpo_log(a, b, BETA, COMPARED, what=f"step {a['step']}"))
    assert one["logs"][0]["loss"] != pytest.approx(one["logs"][-1]["loss"], rel=1e-3)  # steps really differ
    assert len(one["weights"]) == len(other["weights"]) > 100
    start, end = torch.tensor(one["initial"]), torch.tensor(one["weights"])
    worst_weight = assert_within(torch.tensor(other["weights"]), end, weights_scale(start, end), what="weights")
    return worst_metric, worst_weight


@pytest.mark.parametrize("case", ["ref", "lora", "precomputed"])
def test_two_gloo_ranks_on_tree_lines_equal_one_process(runs, case):
    engine = runs[f"ddp-{case}"]["engine"]
    assert "over 2 processes" in engine and "FSDP" not in engine, engine
    _same_training(runs[case], runs[f"ddp-{case}"])


def test_gradient_accumulation_on_tree_lines_equals_one_micro_batch(runs):
    _same_training(runs["ref"], runs["accumulated"])


@pytest.mark.parametrize("case", ["ref", "lora", "precomputed"])
def test_fsdp2_on_tree_lines_equals_one_process(runs, case):
    engine = runs[f"fsdp-{case}"]["engine"]
    assert re.match(r"FSDP2 over 2 processes: (\d+) of \1 parameters sharded", engine), engine  # all of them
    _same_training(runs[case], runs[f"fsdp-{case}"])


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("case", ["default-ref", "ref"])
def test_zero3_on_tree_lines_equals_one_process(runs, case):
    partitioned, params = runs[f"zero3-{case}"]["partitioned"]
    assert partitioned == params > 0  # every policy parameter held only its partition on the rank
    _same_training(runs[case], runs[f"zero3-{case}"])
