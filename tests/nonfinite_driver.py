"""Driver of tests/test_nonfinite.py's multi-process checks: `torchrun --nproc_per_node 2 nonfinite_driver.py
OUT_DIR CLI_MODEL CLI_DATA [zero]` (gloo, CPU; `zero` adds the DeepSpeed cases, with DS_ACCELERATOR=cpu).

Cases: DDP, FSDP2, the command line, then (with `zero`) DeepSpeed ZeRO-2 and ZeRO-3. Each training case
trains a tiny Llama with a fault injected on rank 1 only at optimizer step 2 (`FAULT_STEP`): a NaN
gradient (a backward hook on the embedding output, the loss stays finite) or a NaN loss (added to one
micro-batch's loss). Each rank writes `OUT_DIR/<case>.rank<r>.json`: the error it
raised (if any), whether its weights after the error (or at the end) equal those after step 1, whether
weights and optimizer state after step 2 equal those after step 1, and the logged `nonfinite_skipped`.
`prefixdpo train` on the command line gets the same NaN loss on rank 1; the driver exits with its exit
code, so torchrun's own exit code and the printed error line can be checked.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import leave_ranks, make_examples, tiny_model  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from prefixdpo.dpo.config import PrefixDPOConfig  # noqa: E402
from prefixdpo.core.forward import unwrap  # noqa: E402
from prefixdpo.training.nonfinite import NonFiniteLossError  # noqa: E402
from prefixdpo.dpo.trainer import PrefixDPOTrainer  # noqa: E402

FAULT_STEP, FAULT_RANK = 2, 1
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
FSDP = dict(fsdp="full_shard auto_wrap",
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})


def zero(stage: int) -> dict:
    """A DeepSpeed config of ZeRO `stage` (every value Trainer knows left "auto")."""
    opt = {"stage": stage}
    if stage == 3:  # partition every parameter of the tiny model
        opt.update(stage3_param_persistence_threshold=0, reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto")
    return {"deepspeed": {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
                          "zero_optimization": opt}}


CASES = {
    "ddp-stop-grad": dict(fault="grad"),
    "ddp-stop-loss": dict(fault="loss_after_poison"),  # grads stay finite: only the gathered flag stops rank 0
    "ddp-skip-grad": dict(fault="grad", nonfinite="skip"),
    "fsdp-stop-grad": dict(fault="grad", **FSDP),
    "fsdp-skip-loss": dict(fault="loss", nonfinite="skip", **FSDP),
}
ZERO_CASES = {
    "zero2-stop-grad": dict(fault="grad", **zero(2)),
    "zero2-skip-loss": dict(fault="loss", nonfinite="skip", **zero(2)),
    "zero3-stop-loss": dict(fault="loss", **zero(3)),
    "zero3-skip-grad": dict(fault="grad", nonfinite="skip", **zero(3)),
}


def full_weights(model) -> torch.Tensor:
    """Every parameter, whole, as one flat tensor (a collective under FSDP2 and ZeRO-3: every rank calls it)."""
    params = list(unwrap(model).parameters())
    if hasattr(params[0], "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return torch.cat([p.detach().flatten().clone() for p in params])
    whole = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]
    return torch.cat([w.flatten().clone() for w in whole])


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """This rank's optimizer state (AdamW moments, step counts) and the parameters it updates (ZeRO's fp32
    partitions), found under accelerate's and DeepSpeed's wrappers."""
    while hasattr(optimizer, "optimizer"):  # accelerate's wrapper (a torch Optimizer itself), ZeRO's, then torch's
        optimizer = optimizer.optimizer
    out = []
    # keyed by the parameters the optimizer updates (ZeRO-3 empties its param_groups between steps)
    for p, state in optimizer.state.items():
        out.append(p.detach())
        out.extend(v for v in state.values() if torch.is_tensor(v))
    return [(t.to_local() if hasattr(t, "to_local") else t).clone() for t in out]


class Record(TrainerCallback):
    """Snapshots of the weights and optimizer state at the end of steps 1 and 2; the NaN gradient fault."""

    def __init__(self, trainer_ref, fault: str):
        self.trainer_ref, self.fault, self.hook = trainer_ref, fault, None
        self.weights, self.opt = {}, {}

    def on_step_begin(self, args, state, control, model=None, **kw):
        if self.fault == "grad" and state.global_step + 1 == FAULT_STEP and RANK == FAULT_RANK:
            def nan_grad(module, inputs, output):
                output.register_hook(lambda g: torch.full_like(g, float("nan")))
            self.hook = unwrap(model).get_input_embeddings().register_forward_hook(nan_grad)

    def on_step_end(self, args, state, control, model=None, **kw):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        if state.global_step in (1, 2):
            self.weights[state.global_step] = full_weights(model)
            self.opt[state.global_step] = optimizer_tensors(self.trainer_ref[0].optimizer)


class Faulty(PrefixDPOTrainer):
    """A NaN added to the loss of the first micro-batch of step FAULT_STEP on FAULT_RANK: inside
    `_compute_loss` (before the non-finite loss is made to reach the gradients) or after `compute_loss`."""

    fault = None

    def _nan_now(self) -> bool:
        return self.state.global_step + 1 == FAULT_STEP and RANK == FAULT_RANK

    def _compute_loss(self, model, inputs, return_outputs):
        loss = super()._compute_loss(model, inputs, return_outputs)
        return loss + float("nan") if self.fault == "loss" and self._nan_now() else loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss + float("nan") if self.fault == "loss_after_poison" and self._nan_now() else loss


def run_case(out_dir: str, name: str, fault: str, **options) -> dict:
    args = PrefixDPOConfig(
        output_dir=os.path.join(out_dir, name), per_device_train_batch_size=2, max_steps=3, logging_steps=1,
        learning_rate=1e-2, lr_scheduler_type="constant", save_strategy="no", use_cpu=True, disable_tqdm=True,
        seed=0, beta=0.5, report_to="none", ddp_backend="gloo", gradient_checkpointing=False, **options)
    trainer_ref = []
    record = Record(trainer_ref, fault)
    trainer = type("Case", (Faulty,), {"fault": fault})(
        model=tiny_model("llama"), args=args, train_dataset=make_examples(12), callbacks=[record])
    trainer_ref.append(trainer)
    error = None
    try:
        trainer.train()
    except NonFiniteLossError as err:
        error = str(err)
    now = full_weights(trainer.model_wrapped)
    w1, w2 = record.weights.get(1), record.weights.get(2)
    o1, o2 = record.opt.get(1), record.opt.get(2)
    skipped = [h["nonfinite_skipped"] for h in trainer.state.log_history if "nonfinite_skipped" in h]
    return {
        "error": error, "global_step": trainer.state.global_step,
        "now_equals_step1": bool(torch.equal(now, w1)),
        "now_finite": bool(torch.isfinite(now).all()),
        "step2_equals_step1": None if w2 is None else bool(torch.equal(w2, w1)),
        "opt_step2_equals_step1": None if o2 is None else all(torch.equal(a, b) for a, b in zip(o1, o2, strict=True)),
        "opt_tensors": None if o1 is None else len(o1),
        "step3_moved": bool(not torch.equal(now, w1)),
        "nonfinite_skipped": skipped,
    }


def run_command_line(out_dir: str, model_dir: str, data: str) -> int:
    """`prefixdpo train` with a NaN loss on rank 1 at step 2; returns its exit code."""
    from prefixdpo import cli

    original = PrefixDPOTrainer._compute_loss

    def nan_on_rank1(self, model, inputs, return_outputs):
        loss = original(self, model, inputs, return_outputs)
        return loss + float("nan") if self.state.global_step + 1 == FAULT_STEP and RANK == FAULT_RANK else loss

    PrefixDPOTrainer._compute_loss = nan_on_rank1
    try:
        return cli.main(["train", "--model", model_dir, "--dataset", data, "--output_dir",
                         os.path.join(out_dir, "cli"), "--max_steps", "3", "--per_device_train_batch_size", "2",
                         "--save_strategy", "steps", "--save_steps", "1", "--use_cpu", "--ddp_backend", "gloo",
                         "--report_to", "none", "--disable_tqdm", "true", "--gradient_checkpointing", "false",
                         "--logging_steps", "1"])
    finally:
        PrefixDPOTrainer._compute_loss = original


def save_case(out_dir: str, name: str, result: dict) -> None:
    with open(os.path.join(out_dir, f"{name}.rank{RANK}.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh)


def main(out_dir: str, model_dir: str, data: str, *engines: str) -> int:
    import gc

    gc.freeze()  # Trainer.train runs gc.collect(); what is imported so far need not be scanned each time
    for name, options in CASES.items():
        save_case(out_dir, name, run_case(out_dir, name, **options))
    # before DeepSpeed: a ZeRO-3 config, once made, can leave transformers loading models partitioned
    code = run_command_line(out_dir, model_dir, data)
    for name, options in (ZERO_CASES if "zero" in engines else {}).items():
        save_case(out_dir, name, run_case(out_dir, name, **options))
    return code


if __name__ == "__main__":
    leave_ranks(main(*sys.argv[1:]))
