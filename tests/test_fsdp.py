"""FSDP2 (torch `fully_shard` through accelerate's own FSDP2 path) on CPU over gloo, 2 processes, against one
process with the same global batch; and the global step plan with packing over ranks and accumulation.

One 2-process launch and one 1-process launch run every case; the tests compare their results.
- Per-step loss and metrics within K_FORWARD eps x their magnitudes (`tolerances.assert_same_dpo_log`) and final
  weights within K eps x `weights_scale` (fp32, SGD), prefix sharing on, packing on
  (16 records that make a pack count the ranks do not divide) and off; with a separate reference model,
  with LoRA (adapter-off reference), with TR-DPO (the sharded reference mixed toward the policy each step),
  with precomputed reference tables, and with prefix reuse (against one process without it: the same math). Every
  FSDP case asserts the parameters were DTensors sharded over the 2 ranks during the steps (each rank held half the
  elements), not only that the run finished.
- Packing: 1 process x 4 == 2 ranks x 2 (FSDP2 and plain DDP) == 1 process x 2 x accumulation 2.
- FSDP2 save at step 2 (sharded checkpoint), resume to step 4 == uninterrupted; the exported model reloads
  with stock `from_pretrained` and gives the trained model's logits.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from conftest import run_processes
from tolerances import K, K_FORWARD, assert_same_dpo_log, assert_within, weights_scale

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import finish_ranks, make_examples, tiny_model
    from transformers import TrainerCallback
    from prefixdpo import PrefixDPOConfig
    from prefixdpo.core.engines import local_numel, sharded_parameter_count
    from prefixdpo import PrefixDPOTrainer

    import gc
    gc.freeze()
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    FSDP = dict(fsdp="full_shard auto_wrap",
                fsdp_config={{"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}})

    class Shards(TrainerCallback):
        # (sharded DTensor parameters, all parameters, elements on this rank) at every step end
        def __init__(self):
            self.seen = []
        def on_step_end(self, args, state, control, model=None, **kw):
            self.seen.append((*sharded_parameter_count(model), local_numel(model)))

    def args(name, **kw):
        base = dict(output_dir=os.path.join(out_dir, name), logging_steps=1, learning_rate=0.5, optim="sgd",
                    lr_scheduler_type="constant", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                    beta=0.5, report_to="none", ddp_backend="gloo" if world > 1 else None,
                    gradient_checkpointing=False, max_steps=4)
        base.update(kw)
        return PrefixDPOConfig(**base)

    def full_params(model):
        out = {{}}
        for n, p in model.named_parameters():
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            if p.requires_grad:
                out[n.replace("_fsdp_wrapped_module.", "")] = t.flatten()[:: max(1, t.numel() // 200)].tolist()
        return out

    class StopAt(TrainerCallback):
        # an interruption: training stops after `step`, its checkpoint written (as if the job were killed there)
        def __init__(self, step):
            self.step = step
        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= self.step:
                control.should_training_stop = True

    def run(name, peft=False, ref=False, resume=None, stop_after=None, **kw):
        model = tiny_model("llama")
        extra = {{}}
        if peft:
            from peft import LoraConfig
            extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              lora_dropout=0.0, init_lora_weights=False)
        if ref:
            reference = tiny_model("llama")
            with torch.no_grad():
                for p in reference.parameters():
                    p.mul_(0.9)
            extra["ref_model"] = reference
        shards = Shards()
        callbacks = [shards]
        if stop_after:
            callbacks.append(StopAt(stop_after))
        t = PrefixDPOTrainer(model=model, train_dataset=make_examples(16, ks=(2, 3)), args=args(name, **kw),
                             callbacks=callbacks, **extra)
        initial = full_params(t.model)
        t.train(resume_from_checkpoint=resume)
        total = sum(p.numel() for p in t.model.parameters())
        return t, {{"logs": [h for h in t.state.log_history if "loss" in h], "initial": initial,
                    "params": full_params(t.model), "shards": shards.seen, "total": int(total)}}

    results = {{}}
    packed = dict(packing=True, pack_length=64)
    TRDPO = dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.6)  # reference moves each step
    if world > 1:
        for name, kw in (("fsdp-packed", dict(packed, **FSDP)), ("fsdp-unpacked", FSDP),
                         ("ddp-packed", packed), ("fsdp-ref", dict(FSDP, ref=True)),
                         ("fsdp-lora", dict(packed, peft=True, **FSDP)), ("fsdp-trdpo", dict(FSDP, **TRDPO)),
                         ("fsdp-precomputed", dict(FSDP, ref=True, precompute_ref_log_probs=True))):
            results[name] = run(name, per_device_train_batch_size=2, **kw)[1]
        # save at step 2 (of 4: the schedule is the uninterrupted run's), resume to 4; export the final model.
        # AdamW: torch's full optimizer state dict cannot load a stateless optimizer (plain SGD) under FSDP2.
        # Checkpoints sharded (SHARDED_STATE_DICT, as examples/accelerate/fsdp2.yaml); the export is whole.
        sharded = dict(FSDP, fsdp_config=dict(FSDP["fsdp_config"], state_dict_type="SHARDED_STATE_DICT"))
        adam = dict(packed, optim="adamw_torch", learning_rate=1e-2, **sharded)
        results["fsdp-whole"] = run("fsdp-whole", per_device_train_batch_size=2, **adam)[1]
        run("fsdp-save", per_device_train_batch_size=2, save_strategy="steps", save_steps=2, max_steps=4,
            stop_after=2, **adam)
        t, results["fsdp-resumed"] = run("fsdp-resumed", per_device_train_batch_size=2,
                                         resume=os.path.join(out_dir, "fsdp-save", "checkpoint-2"), **adam)
        t.save_model(os.path.join(out_dir, "export"))
        probe = torch.tensor([[5, 6, 7, 8, 9, 10]])
        with torch.no_grad():
            logits = t.model(input_ids=probe).logits
        results["export-logits"] = logits.flatten().tolist()
        # prefix reuse: each rank's lines need their own numbers of chunk passes; the ranks agree on one shape
        results["fsdp-reused"] = run("fsdp-reused", per_device_train_batch_size=2, prefix_reuse=True,
                                     max_tokens_per_pass="8", **FSDP)[1]
    else:
        for name, kw in (("packed", packed), ("unpacked", {{}}), ("ref", dict(ref=True)),
                         ("lora", dict(packed, peft=True)), ("trdpo", TRDPO),
                         ("precomputed", dict(ref=True, precompute_ref_log_probs=True))):
            results[name] = run(name, per_device_train_batch_size=4, **kw)[1]
        results["packed-accumulated"] = run("packed-accumulated", per_device_train_batch_size=2,
                                            gradient_accumulation_steps=2, **packed)[1]
    finish_ranks(rank, out_dir, results)
    """
)


def _run(tmp_path, nproc: int) -> dict:
    script = tmp_path / "fsdp_script.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / f"np{nproc}"
    out.mkdir()
    run_processes(nproc, str(script), str(out))
    return json.loads((out / "result.json").read_text()), out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    one, _ = _run(tmp, 1)
    two, out = _run(tmp, 2)
    return one, two, out


def _flat(params: dict) -> torch.Tensor:
    return torch.tensor([x for k in sorted(params) for x in params[k]])


def _same_training(a: dict, b: dict, steps=slice(None), k: float = K_FORWARD) -> None:
    """`b` trained as `a` did over the logged `steps` of each: their metrics within k eps x their magnitudes
    (`assert_same_dpo_log`), the final weights within K eps x `weights_scale` from `a`'s initial ones."""
    logs_a, logs_b = a["logs"][steps], b["logs"][steps]
    assert len(logs_a) == len(logs_b) > 0
    for x, y in zip(logs_a, logs_b):
        assert_same_dpo_log(x, y, 0.5, METRICS, k=k, what=f"step {x['step']}")
    assert a["params"].keys() == b["params"].keys() and a["params"]
    end = _flat(a["params"])
    assert_within(_flat(b["params"]), end, weights_scale(_flat(a["initial"]), end), what="final weights")


def _really_sharded(run: dict) -> None:
    assert len(run["shards"]) == 4
    for sharded, params, local in run["shards"]:
        assert sharded == params > 0  # every parameter a DTensor sharded over the mesh
        assert local <= run["total"] // 2 + 64  # this rank held (about) half of the elements


@pytest.mark.parametrize("fsdp, single", [("fsdp-packed", "packed"), ("fsdp-unpacked", "unpacked"),
                                          ("fsdp-ref", "ref"), ("fsdp-lora", "lora"), ("fsdp-trdpo", "trdpo"),
                                          ("fsdp-precomputed", "precomputed")])
def test_fsdp2_two_ranks_equal_one_process(runs, fsdp, single):
    one, two, _ = runs
    _really_sharded(two[fsdp])
    assert len(one[single]["logs"]) == 4
    assert one[single]["logs"][-1]["loss"] != pytest.approx(one[single]["logs"][0]["loss"], rel=1e-3)  # it trained
    _same_training(one[single], two[fsdp])


def test_fsdp2_with_prefix_reuse_equals_one_process_with_one_row_per_example(runs):
    """Budget 8 tokens a pass: most lines run their prompt once and their responses in 1-3 chunks, differently on
    the two ranks (their passes aligned: `prefix_reuse.agreed_shape`; test_reuse_sharded checks the shapes)."""
    one, two, _ = runs
    _really_sharded(two["fsdp-reused"])
    _same_training(one["unpacked"], two["fsdp-reused"])


def test_packed_steps_do_not_depend_on_world_size_or_accumulation(runs):
    one, two, _ = runs
    _same_training(one["packed"], two["ddp-packed"])  # 2 ranks x 2 (plain DDP)
    _same_training(one["packed"], one["packed-accumulated"])  # 1 process x 2 x accumulation 2
    assert two["ddp-packed"]["shards"][0][0] == 0  # plain DDP: nothing sharded


def test_fsdp2_resume_equals_uninterrupted_and_exports_a_stock_model(runs):
    from transformers import AutoModelForCausalLM

    _, two, out = runs
    whole, resumed = two["fsdp-whole"], two["fsdp-resumed"]
    assert [h["step"] for h in resumed["logs"][-2:]] == [3, 4]
    # steps 3 and 4, after the resume (AdamW: K; Adam turns rounding in a gradient entry near 0 into a step of lr)
    _same_training(whole, resumed, steps=slice(-2, None), k=K)
    loaded = AutoModelForCausalLM.from_pretrained(str(out / "export"))
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]])).logits.flatten()
    want = torch.tensor(two["export-logits"])  # the same weights through the stock model: its own rounding
    assert_within(logits, want, want.abs().max().item(), k=K_FORWARD, what="exported logits")


def test_fsdp_in_one_cpu_process_is_refused_in_one_line(tmp_path):
    """accelerate would silently train without FSDP here; we refuse, naming what to do."""
    from conftest import make_examples, tiny_model
    from prefixdpo import PrefixDPOConfig
    from prefixdpo.errors import ConfigError
    from prefixdpo import PrefixDPOTrainer

    args = PrefixDPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", gradient_checkpointing=False,
                           fsdp="full_shard auto_wrap", fsdp_config={"version": 2})
    with pytest.raises(ConfigError, match="launch it with several processes"):
        PrefixDPOTrainer(model=tiny_model("llama"), train_dataset=make_examples(4), args=args)


def test_cli_two_processes_fsdp2_on_the_embedded_default(tmp_path):
    """`torchrun -m prefixdpo.cli train --fsdp ...` from a fresh folder: one process builds the embedded default
    while the other waits (both building it at once let one read a half-written model), and the run says
    that FSDP2 sharded every parameter."""
    proc = run_processes(2, "-m", "prefixdpo.cli", "train", "--max_steps", "1", "--output_dir", str(tmp_path / "run"),
                         "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true",
                         "--fsdp", "full_shard auto_wrap", "--fsdp_config",
                         json.dumps({"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}),
                         cwd=tmp_path, timeout=600)
    engine = [line for line in proc.stdout.splitlines() if line.startswith("Engine:")]
    assert len(engine) == 2 and all("FSDP2 over 2 processes: 21 of 21 parameters sharded" in e for e in engine), engine
