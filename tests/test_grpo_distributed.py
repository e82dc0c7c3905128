"""`PrefixGRPOTrainer` over 2 gloo processes == 1 process: plain DDP and FSDP2 (torch `fully_shard` through
accelerate's FSDP2 path, the reference model sharded too), on CPU.

TRL seeds its sampler per rank, so 2 ranks would sample other completions than 1 process: the rollouts come
from a `rollout_func` (TRL's hook) that draws each completion from a seed of (step, prompt, index in its group),
the same whatever the world size. The rest is TRL's: rewards gathered over ranks, group advantages, the three
log-prob passes (policy, old policy with num_iterations 2, reference with beta > 0) on prefix-shared, packed rows.
Asserted over 4 SGD steps: every metric as in test_grpo_trl_parity (`metric_within`, from `tolerances`), sampled
final weights within K eps x `weights_scale`, the weights moved, and under FSDP2 every parameter was a DTensor
sharded over the 2 ranks during the steps (each rank held about half the elements); FSDP2 also with prefix reuse.
Two launches, ~30 s on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from conftest import run_processes
from test_grpo_trl_parity import metric_within
from tolerances import assert_within, weights_scale

SCRIPT = textwrap.dedent(
    """
    import hashlib, os, random, sys
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import finish_ranks
    from grpo_common import INSTRUCTION, reward_vowels, tokenizer
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from prefixdpo.core.engines import local_numel, sharded_parameter_count
    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer

    out_dir, model_dir = sys.argv[1], sys.argv[2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    FSDP = dict(fsdp="full_shard auto_wrap",
                fsdp_config={{"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}})
    tok = tokenizer()

    def rollout(prompts, trainer):
        # one completion per row, drawn from a seed of (step, prompt, its index among equal prompts here)
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        seen, completions = {{}}, []
        for text in prompts:
            k = seen[text] = seen.get(text, -1) + 1
            rng = random.Random(hashlib.sha256(f"{{trainer.state.global_step}}|{{k}}|{{text}}".encode()).hexdigest())
            ids = [rng.randrange(5, len(tok)) for _ in range(rng.randint(1, 10))]
            if rng.random() < 0.5:
                ids[-1] = tok.eos_token_id
            completions.append(ids)
        return {{"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}}

    class Shards(TrainerCallback):
        def __init__(self):
            self.seen = []
        def on_step_end(self, args, state, control, model=None, **kw):
            self.seen.append((*sharded_parameter_count(model), local_numel(model)))

    def sampled_params(model):
        out = {{}}
        for n, p in model.named_parameters():
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[n] = t.flatten()[:: max(1, t.numel() // 200)].tolist()
        return out

    def run(name, per_device, **kw):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        initial = sampled_params(model)
        # distinct prompts: a group's index among equal prompts is its index in the group on any world size
        data = Dataset.from_dict({{"prompt": [f"{{INSTRUCTION}}question {{i}}?" for i in range(32)]}})
        args = PrefixGRPOConfig(
            output_dir=os.path.join(out_dir, name), max_steps=4, logging_steps=1, learning_rate=0.5, optim="sgd",
            lr_scheduler_type="constant", use_cpu=True, bf16=False, report_to="none", gradient_checkpointing=False,
            save_strategy="no", seed=0, disable_tqdm=True, max_completion_length=10, num_generations=4,
            per_device_train_batch_size=per_device, beta=0.04, num_iterations=2, loss_type="dapo",
            ddp_backend="gloo" if world > 1 else None, **kw)
        shards = Shards()
        trainer = PrefixGRPOTrainer(model=model, reward_funcs=reward_vowels, args=args, train_dataset=data,
                                    processing_class=tok, rollout_func=rollout, callbacks=[shards])
        trainer.train()
        logs = [{{k: v for k, v in h.items() if k != "step_time"}} for h in trainer.state.log_history if "loss" in h]
        return {{"logs": logs, "initial": initial, "params": sampled_params(trainer.model), "shards": shards.seen,
                "total": int(sum(p.numel() for p in trainer.model.parameters()))}}

    if world > 1:
        results = {{"ddp": run("ddp", 4), "fsdp": run("fsdp", 4, **FSDP),
                    # every group over 12 tokens: its prompt once, its completions (random lengths) in 1-4 chunks
                    "fsdp-reused": run("fsdp-reused", 4, prefix_reuse=True, max_tokens_per_pass="12", **FSDP)}}
    else:
        results = {{"one": run("one", 8)}}
    finish_ranks(rank, out_dir, results)
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from grpo_common import saved_tiny_model

    tmp = tmp_path_factory.mktemp("grpo_dist")
    model_dir = saved_tiny_model(tmp / "model")
    script = tmp / "script.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    results = {}
    for nproc in (1, 2):
        out = tmp / f"np{nproc}"
        out.mkdir()
        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func is experimental in TRL 1.16
        run_processes(nproc, str(script), str(out), model_dir)
        results.update(json.loads((out / "result.json").read_text()))
    return results


def _same_training(a: dict, b: dict) -> float:
    assert len(a["logs"]) == len(b["logs"]) == 4
    worst = 0.0
    for step_a, step_b in zip(a["logs"], b["logs"]):
        assert step_a.keys() == step_b.keys() and step_b["prefix_sharing/tokens_saved"] > 0
        for key in step_a.keys() - {"packing/efficiency", "epoch", "step"}:  # each rank packs its own groups
            worst = max(worst, metric_within(key, float(step_a[key]), float(step_b[key]), step_a))
    flat_a, flat_b, flat_0 = (torch.tensor([x for k in a["params"] for x in run[k]])
                              for run in (a["params"], b["params"], a["initial"]))
    assert (flat_a - flat_0).abs().max() > 0.01  # the weights moved
    assert_within(flat_b, flat_a, weights_scale(flat_0, flat_a), what="sampled final weights")
    return worst


def test_ddp_two_ranks_equal_one_process(runs):
    worst = _same_training(runs["one"], runs["ddp"])
    assert runs["ddp"]["shards"][0][0] == 0  # plain DDP: nothing sharded
    print(f"REPORT grpo ddp 2 ranks vs 1 process: worst metric difference {worst:.2f} eps x its scale")


@pytest.mark.parametrize("name", ["fsdp", "fsdp-reused"])
def test_fsdp2_two_ranks_equal_one_process(runs, name):
    """`fsdp-reused`: with prefix reuse (the ranks' groups need different numbers of chunk passes, which the ranks
    agree on: `core.prefix_reuse`) against one process without it (the same math)."""
    fsdp = runs[name]
    assert len(fsdp["shards"]) == 4
    for sharded, params, local in fsdp["shards"]:
        assert sharded == params > 0  # every parameter a DTensor sharded over the mesh
        assert local <= fsdp["total"] // 2 + 64  # this rank held (about) half of the elements
    worst = _same_training(runs["one"], fsdp)
    print(f"REPORT grpo {name} 2 ranks vs 1 process: worst metric difference {worst:.2f} eps x its scale")
