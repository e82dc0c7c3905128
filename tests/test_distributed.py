"""2-process DDP over gloo on CPU (torchrun) against one process.

1. Training: same per-step losses and final weights as one process with the same global batch, and no hang
   when the data does not split evenly over the ranks (7 examples over 2 ranks unpacked: rank 1 runs an
   empty slot; 5 packed examples: a zero-weight batch). Losses and rewards within K_FORWARD eps x beta x the log-prob
   sums' scale, weights within K eps x `weights_scale` (fp32, SGD; `tolerances`).
2. Every loss: one optimizer step over the same 8 examples (K = 2 and 3 responses) laid out six ways —
   unpacked in one micro-batch, packed, 2 micro-batches of gradient accumulation, 2 gloo ranks, and prefix reuse
   (every prompt once, its responses in chunks against its K/V) in one process and over 2 gloo ranks (sigmoid and
   the coupled sft, bco_pair and aot) — gives the same loss (within K_FORWARD eps x (1 + loss) x the sums' scale:
   every loss of the table is logistic or linear in margins of the sums with slope <= beta <= 1, or a square, slope
   2 sqrt(L) <= 1 + L) and the same gradient (the SGD update, within K eps of its largest entry).
   The reference differs from the policy, so margins are spread out and sorting losses (aot) see no ties.
"""

from __future__ import annotations

import json
import os
import textwrap

import torch
from conftest import run_processes, tiny_model
from tolerances import K_FORWARD, assert_within, dpo_loss_scale, sgd_grad_scale, weights_scale

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import finish_ranks, make_examples, tiny_model
    from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer
    from prefixdpo.dpo.loss_table import LOSS_TABLE

    import gc
    gc.freeze()  # Trainer.train runs gc.collect(); everything imported so far need not be scanned again each time
    out_dir, job = sys.argv[1], sys.argv[2]
    LR = 100.0
    # prefix reuse over 2 ranks: the plain loss and those coupled across the step's pairs (every loss in one process)
    RANKS_REUSED_LOSSES = ("sigmoid", "sft", "bco_pair", "aot")
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def args(name, **kw):
        base = dict(output_dir=os.path.join(out_dir, name), logging_steps=1, learning_rate=0.5, optim="sgd",
                    lr_scheduler_type="constant", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                    beta=0.5, report_to="none", ddp_backend="gloo" if world > 1 else None,
                    gradient_checkpointing=False)
        base.update(kw)
        return PrefixDPOConfig(**base)

    def flat(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    results = {{}}
    if job == "train":
        for name, n, extra in (("unpacked", 7, {{}}), ("packed", 5, {{"packing": True, "pack_length": 64}})):
            batch = int(sys.argv[3]) if name == "unpacked" else 1
            t = PrefixDPOTrainer(model=tiny_model("llama"), train_dataset=make_examples(n, ks=(2, 3)),
                                 args=args(name, per_device_train_batch_size=batch, max_steps=-1, num_train_epochs=2,
                                           **extra))
            t.train()
            logs = [h for h in t.state.log_history if "loss" in h]
            params = flat(t.model)
            results[name] = {{"logs": logs, "params": params[:: max(1, params.numel() // 2000)].tolist()}}
    else:  # job == "losses": one optimizer step per loss and layout
        reuse = dict(prefix_reuse=True, max_tokens_per_pass="8")  # every line: its prompt once, then chunks
        layouts = {{"unpacked": dict(per_device_train_batch_size=8),
                    "packed": dict(per_device_train_batch_size=16, packing=True, pack_length=64),
                    "accumulated": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
                    "reused": dict(per_device_train_batch_size=8, **reuse)}}
        if world > 1:
            layouts = {{"ranks": dict(per_device_train_batch_size=4),
                        "ranks-reused": dict(per_device_train_batch_size=4, **reuse)}}
        examples = make_examples(8, ks=(2, 3))
        reference = tiny_model("llama")
        with torch.no_grad():
            for p in reference.parameters():
                p.mul_(0.9)
        for loss in sorted(LOSS_TABLE):
            for layout, kw in layouts.items():
                if layout == "ranks-reused" and loss not in RANKS_REUSED_LOSSES:
                    continue
                policy = tiny_model("llama")
                before = flat(policy)
                # a large SGD step makes (after - before) / lr the gradient with little weight rounding in it
                t = PrefixDPOTrainer(model=policy, ref_model=reference, train_dataset=examples,
                                     args=args(f"{{loss}}-{{layout}}", max_steps=1, loss_type=[loss],
                                               label_smoothing=0.1, learning_rate=LR, max_grad_norm=0, **kw))
                t.train()
                log = [h for h in t.state.log_history if "loss" in h][0]
                update = (flat(t.model) - before) / LR  # SGD: -gradient
                results[f"{{loss}}/{{layout}}"] = {{"log": log,
                                                   "grad": update[:: max(1, update.numel() // 4000)].tolist()}}
    finish_ranks(int(os.environ.get("RANK", "0")), out_dir, results)
    """
)


def _run(tmp_path, nproc: int, *job: str) -> dict:
    script = tmp_path / "ddp_script.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / f"{job[0]}-np{nproc}"
    out.mkdir()
    run_processes(nproc, str(script), str(out), *job)
    return json.loads((out / "result.json").read_text())


def test_two_process_ddp_matches_one_process(tmp_path):
    one = _run(tmp_path, 1, "train", "4")  # global batch 4 in one process
    two = _run(tmp_path, 2, "train", "2")  # 2 ranks x 2
    u1, u2 = one["unpacked"], two["unpacked"]
    assert len(u1["logs"]) == len(u2["logs"]) == 4  # 2 steps per epoch (4 + 3 examples), 2 epochs
    for a, b in zip(u1["logs"], u2["logs"]):
        scale = dpo_loss_scale(a, 0.5)
        assert_within(b["loss"], a["loss"], scale, k=K_FORWARD, what=f"step {a['step']} loss")
        assert_within(b["rewards/chosen"], a["rewards/chosen"], scale, k=K_FORWARD, what=f"step {a['step']} rewards")
    params = torch.cat([p.detach().flatten() for p in tiny_model("llama").parameters()])
    start = params[:: max(1, params.numel() // 2000)]
    end = torch.tensor(u1["params"])
    assert_within(torch.tensor(u2["params"]), end, weights_scale(start, end), what="sampled weights")
    # packed, uneven: it finished on both ranks (no hang) and learned something finite
    p2 = two["packed"]
    assert p2["logs"] and all(h["loss"] == h["loss"] for h in p2["logs"])


# DiscoPOP's gate sigmoid(beta h / tau) (TRL's tau 0.05) has slope 1 / (4 tau) = 5 at its middle, where two of these
# pairs' margins sit (beta h / tau ~ -0.7 and -0.3): it turns their slopes' sign, so the step's gradient is a difference
# of terms up to 1 + 1 / (4 tau) times its largest entry. Measured under prefix reuse: 76-81 eps x the largest entry
# in fp32, and 74 eps x it in float64 (tolerances.float64_model): the same in float64's units, so rounding only.
GRADIENT_TERMS = {"discopop": 1 + 1 / (4 * 0.05)}


def test_every_loss_is_the_same_for_any_layout_of_the_step(tmp_path):
    from prefixdpo.dpo.loss_table import LOSS_TABLE

    one = _run(tmp_path, 1, "losses")
    two = _run(tmp_path, 2, "losses")
    results = {**one, **two}
    start = torch.cat([p.detach().flatten() for p in tiny_model("llama").parameters()])
    for loss in sorted(LOSS_TABLE):
        base = results[f"{loss}/unpacked"]
        grad_scale = max(abs(g) for g in base["grad"])
        assert grad_scale > 1e-4, loss  # the step moved the weights: the comparison means something
        log = base["log"]
        scale = dpo_loss_scale(log, 0.5, slope=1 + abs(log["loss"]))
        for layout in ("packed", "accumulated", "ranks", "reused", "ranks-reused"):
            if f"{loss}/{layout}" not in results:
                assert layout == "ranks-reused" and loss not in ("sigmoid", "sft", "bco_pair", "aot"), (loss, layout)
                continue
            other = results[f"{loss}/{layout}"]
            assert_within(other["log"]["loss"], log["loss"], scale, k=K_FORWARD, what=f"{loss} {layout} loss")
            terms = sgd_grad_scale(torch.tensor(base["grad"]), start, 100.0) * GRADIENT_TERMS.get(loss, 1.0)
            assert_within(other["grad"], base["grad"], terms, what=f"{loss} {layout} gradient")
