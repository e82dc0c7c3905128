"""A step is applied only if it is finite everywhere (`nonfinite=stop|skip`).

Faults are injected, never reasoned about: a NaN gradient (a backward hook on the embedding output: the loss
stays finite) or a NaN loss (added to one micro-batch's loss) at optimizer step k.

- stop, one process: the step is never applied (weights after the error == the checkpoint of step k-1,
  exactly), the error names step k and a last good checkpoint whose weights are finite; a NaN loss in the
  first of two accumulated micro-batches likewise; the reward trainer too.
- skip, one process: weights, AdamW state and lr schedule after the skipped step == before it; the whole
  run == a run on the data without that step's batch (`tolerances.assert_same_weights`), with a warm-up schedule
  that would show a scheduler step; `nonfinite_skipped` logged; N consecutive non-finite steps stop the run; the counts come
  back on resume.
- 2 gloo ranks, one torchrun launch (`nonfinite_driver.py`), the fault on rank 1 only: DDP and FSDP2 (stop:
  both ranks stop with weights == step 1's; skip: weights and optimizer state after step 2 == after step 1,
  the run finishes, the count is logged on both), `prefixdpo train` on the command line (torchrun exits
  non-zero, each rank prints the one-line error naming a checkpoint with finite weights), DeepSpeed ZeRO-2
  and ZeRO-3 (stop holds, skip leaves weights and optimizer state untouched).
- `last_good_checkpoint` passes over checkpoints with a NaN/inf weight, a NaN shard, or a truncated file;
  bad option values are one-line ConfigErrors; engines where the policy cannot hold are refused in one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback

from conftest import free_port, make_examples, tiny_model
from prefixdpo.training.checkpoints import last_good_checkpoint, read_state, seal_checkpoint
from prefixdpo.commands.train import parse_train_args
from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer, PrefixRewardConfig
from prefixdpo.errors import ConfigError
from prefixdpo.core.model_checks import unwrap
from prefixdpo.training.nonfinite import NonFiniteLossError, check_engine_support, deepspeed_gap
from prefixdpo.commands.reward import parse_reward_args
from tolerances import assert_same_weights

TESTS = os.path.dirname(os.path.abspath(__file__))


def config(tmp_path, name="out", **kw) -> PrefixDPOConfig:
    base = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=4, logging_steps=1,
                learning_rate=1e-2, lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                disable_tqdm=True, seed=0, beta=0.5, report_to="none", gradient_checkpointing=False,
                train_sampling_strategy="sequential")
    base.update(kw)
    return PrefixDPOConfig(**base)


class NanGradientAt(TrainerCallback):
    """During the backward of the optimizer steps in `steps`, the gradient reaching the embedding output is
    NaN (so are the embedding's weight gradients); the loss stays finite."""

    def __init__(self, steps):
        self.steps, self.hook = set(steps), None

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step + 1 in self.steps:
            def nan_grad(module, inputs, output):
                output.register_hook(lambda g: torch.full_like(g, float("nan")))
            self.hook = unwrap(model).get_input_embeddings().register_forward_hook(nan_grad)

    def on_step_end(self, args, state, control, **kw):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


class Snapshots(TrainerCallback):
    """Weights, optimizer state and lr-scheduler position at the end of every step."""

    def __init__(self, trainer_box):
        self.box, self.at = trainer_box, {}

    def on_step_end(self, args, state, control, model=None, **kw):
        trainer = self.box[0]
        opt = trainer.optimizer.optimizer
        state_tensors = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        self.at[state.global_step] = ({k: v.detach().clone() for k, v in unwrap(model).named_parameters()},
                                      state_tensors, trainer.lr_scheduler.last_epoch)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in unwrap(model).named_parameters()}


def checkpoint_weights(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def assert_equal_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst == 0.0, worst


def nan_loss_trainer(step: int, micro_batch: int = 0):
    """A PrefixDPOTrainer whose `micro_batch`-th micro-batch of optimizer step `step` has a NaN added to its
    loss after `compute_loss` (the gradients stay finite: only the loss check can see it)."""

    class NanLoss(PrefixDPOTrainer):
        seen = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if self.state.global_step + 1 == step:
                self.seen += 1
                if self.seen == micro_batch + 1:
                    return loss + float("nan")
            return loss

    return NanLoss


# ---- stop, one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_reported", [True, False])
def test_nan_gradient_at_step_k_is_never_applied(tmp_path, monkeypatch, norm_reported):
    if not norm_reported:  # a Trainer that no longer reports its norm: the guard checks the gradients itself
        from transformers import Trainer

        from prefixdpo.training.base import PrefixTrainerBase

        monkeypatch.setattr(PrefixTrainerBase, "_get_grad_norm", Trainer._get_grad_norm)
    args = config(tmp_path, save_strategy="steps", save_steps=1, max_steps=5)
    trainer = PrefixDPOTrainer(model=tiny_model("llama"), args=args, train_dataset=make_examples(10),
                               callbacks=[NanGradientAt({3})])
    with pytest.raises(NonFiniteLossError, match="^[^\n]*$") as err:
        trainer.train()
    message = str(err.value)
    last = os.path.join(args.output_dir, "checkpoint-2")
    assert "optimizer step 3: the gradient norm was not finite; stopped before applying it" in message
    assert "loss" not in message.split(";")[0]  # the loss was finite: the gradient check caught it
    assert f"Last good checkpoint: {last}." in message
    assert sorted(os.listdir(args.output_dir)) == ["checkpoint-1", "checkpoint-2"]
    saved = checkpoint_weights(last)
    assert all(torch.isfinite(t).all() for t in saved.values())
    assert_equal_weights(weights(trainer.model), saved)  # step 3 never reached the weights
    first = checkpoint_weights(os.path.join(args.output_dir, "checkpoint-1"))
    assert not torch.equal(saved["model.embed_tokens.weight"], first["model.embed_tokens.weight"])  # it trained


def test_nan_loss_in_an_accumulated_micro_batch_is_never_applied(tmp_path):
    # the NaN is in the first of two accumulated micro-batches: every micro-batch's loss is checked
    args = config(tmp_path, save_strategy="steps", save_steps=1, max_steps=4, per_device_train_batch_size=1,
                  gradient_accumulation_steps=2)
    trainer = nan_loss_trainer(step=2, micro_batch=0)(model=tiny_model("llama"), args=args,
                                                      train_dataset=make_examples(8))
    with pytest.raises(NonFiniteLossError, match="optimizer step 2: the loss of a micro-batch was nan; stopped"):
        trainer.train()
    assert_equal_weights(weights(trainer.model), checkpoint_weights(os.path.join(args.output_dir, "checkpoint-1")))


def test_reward_trainer_has_the_guard(tmp_path):
    from test_reward_scores import tiny_reward_model

    from prefixdpo import PrefixRewardTrainer

    args = PrefixRewardConfig(output_dir=str(tmp_path / "rm"), per_device_train_batch_size=2, max_steps=3,
                              logging_steps=1, learning_rate=1e-2, save_strategy="steps", save_steps=1,
                              use_cpu=True, disable_tqdm=True, seed=0, report_to="none",
                              gradient_checkpointing=False)
    trainer = PrefixRewardTrainer(model=tiny_reward_model("llama"), args=args, train_dataset=make_examples(6),
                                  callbacks=[NanGradientAt({2})])
    with pytest.raises(NonFiniteLossError, match="optimizer step 2: the gradient norm was not finite"):
        trainer.train()
    last = os.path.join(args.output_dir, "checkpoint-1")
    assert_equal_weights(weights(trainer.model), checkpoint_weights(last))
    assert read_state(last)["nonfinite"] == {"skipped": 0, "consecutive": 0}


# ---- skip, one process ------------------------------------------------------------------------------


def test_skip_leaves_the_step_out_exactly(tmp_path):
    """Step 2 skipped == step 2's batch left out of the data: with sequential batches of 2, a warm-up schedule
    (lr factor 0, 0.5, 1, 1: a scheduler step at the skip would shift it) and AdamW (a moment or step-count
    update at the skip would show)."""
    examples = make_examples(8)
    schedule = dict(lr_scheduler_type="constant_with_warmup", warmup_steps=2, optim="adamw_torch")
    box = []
    snapshots = Snapshots(box)
    trainer = PrefixDPOTrainer(model=tiny_model("llama"), args=config(tmp_path, "skip", nonfinite="skip", **schedule),
                               train_dataset=examples, callbacks=[NanGradientAt({2}), snapshots])
    box.append(trainer)
    trainer.train()
    assert trainer.state.global_step == 4
    (w1, opt1, lr1), (w2, opt2, lr2) = snapshots.at[1], snapshots.at[2]
    assert_equal_weights(w2, w1)
    assert len(opt2) == len(opt1) > 0 and all(torch.equal(a, b) for a, b in zip(opt1, opt2))
    assert lr2 == lr1
    assert [h["nonfinite_skipped"] for h in trainer.state.log_history if "loss" in h] == [0, 1, 1, 1]
    assert trainer.state.log_history[-1]["nonfinite_skipped"] == 1  # the run's summary

    without = PrefixDPOTrainer(model=tiny_model("llama"), args=config(tmp_path, "without", max_steps=3, **schedule),
                               train_dataset=examples[:2] + examples[4:])
    without.train()
    assert_same_weights(weights(trainer.model), weights(without.model), what="skipped run vs run without")
    assert not torch.equal(weights(trainer.model)["lm_head.weight"], w1["lm_head.weight"])  # steps 3-4 trained


def test_skip_stops_after_n_consecutive_and_counts_survive_resume(tmp_path):
    examples = make_examples(12)
    skip = dict(nonfinite="skip", nonfinite_max_consecutive=2, save_strategy="steps", save_steps=1, max_steps=6)
    trainer = PrefixDPOTrainer(model=tiny_model("llama"), args=config(tmp_path, "run", **skip),
                               train_dataset=examples, callbacks=[NanGradientAt({2, 3})])
    with pytest.raises(NonFiniteLossError, match="optimizer step 3: 2 consecutive optimizer steps were non-finite"):
        trainer.train()
    out = trainer.args.output_dir
    assert_equal_weights(weights(trainer.model), checkpoint_weights(os.path.join(out, "checkpoint-1")))
    state = read_state(os.path.join(out, "checkpoint-2"))
    assert state["nonfinite"] == {"skipped": 1, "consecutive": 1}

    # resumed from checkpoint-2 (one step already skipped): one more non-finite step is the second in a row
    again = PrefixDPOTrainer(model=tiny_model("llama"), args=config(tmp_path, "run", **skip),
                             train_dataset=examples, callbacks=[NanGradientAt({3})])
    with pytest.raises(NonFiniteLossError, match="optimizer step 3: 2 consecutive"):
        again.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    # resumed without a fault: the run finishes and its count includes the step skipped before the resume
    clean = PrefixDPOTrainer(model=tiny_model("llama"), args=config(tmp_path, "run", **skip), train_dataset=examples)
    clean.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    assert clean.state.global_step == 6 and clean.state.log_history[-1]["nonfinite_skipped"] == 1


# ---- 2 ranks ----------------------------------------------------------------------------------------


HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _cli_inputs(tmp_path) -> tuple[str, str]:
    """A tiny model folder with a tokenizer, and 12 preference records, for `prefixdpo train`."""
    from prefixdpo_tools.demo import DemoSpec, build_model, build_tokenizer, make_records, write_jsonl

    spec = DemoSpec(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4)
    records = make_records(12, seed=0)
    tokenizer = build_tokenizer(records, spec)
    model_dir = tmp_path / "cli-model"
    build_model(tokenizer, spec).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    write_jsonl(records, tmp_path / "cli.jsonl")
    return str(model_dir), str(tmp_path / "cli.jsonl")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One torchrun launch (2 gloo ranks) of every multi-process case: (process, {case: {rank: result}}, out)."""
    tmp = tmp_path_factory.mktemp("nonfinite")
    out = tmp / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
           os.path.join(TESTS, "nonfinite_driver.py"), str(out), *_cli_inputs(tmp),
           *(["zero"] if HAS_DEEPSPEED else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    results = {}
    for name in os.listdir(out):
        if name.endswith(".json"):
            case, rank = name[:-len(".json")].rsplit(".rank", 1)
            results.setdefault(case, {})[int(rank)] = json.loads((out / name).read_text())
    return proc, results, out


def _assert_stopped_at_step_2(case: dict, what: str) -> None:
    for rank in (0, 1):
        r = case[rank]
        assert r["error"] is not None and r["error"].startswith(f"optimizer step 2: {what}"), (rank, r["error"])
        assert r["now_equals_step1"] and r["now_finite"] and r["global_step"] == 1, (rank, r)
    assert case[0]["error"] == case[1]["error"]


def _assert_skipped_step_2(case: dict) -> None:
    for rank in (0, 1):
        r = case[rank]
        assert r["error"] is None and r["global_step"] == 3, (rank, r)
        assert r["step2_equals_step1"] and r["opt_step2_equals_step1"] and r["opt_tensors"] > 0, (rank, r)
        assert r["step3_moved"] and r["now_finite"] and r["nonfinite_skipped"][-1] == 1, (rank, r)


def _cases(two_ranks, *names) -> dict:
    proc, results, _ = two_ranks
    missing = [name for name in names if set(results.get(name, {})) != {0, 1}]
    ranks = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank"))
    assert not missing, (missing, (ranks or proc.stderr)[-6000:])
    return results


def test_two_ranks_ddp_and_fsdp2(two_ranks):
    results = _cases(two_ranks, "ddp-stop-grad", "ddp-stop-loss", "ddp-skip-grad", "fsdp-stop-grad", "fsdp-skip-loss")
    _assert_stopped_at_step_2(results["ddp-stop-grad"], "the gradient norm was not finite")
    # a NaN loss on rank 1 with finite gradients everywhere: the gathered flag stops rank 0 too
    _assert_stopped_at_step_2(results["ddp-stop-loss"], "the loss of a micro-batch was nan on rank 1; stopped")
    _assert_skipped_step_2(results["ddp-skip-grad"])
    _assert_stopped_at_step_2(results["fsdp-stop-grad"], "the gradient norm was not finite")
    _assert_skipped_step_2(results["fsdp-skip-loss"])


def test_two_ranks_command_line_exits_non_zero_with_the_error_line(two_ranks):
    proc, _, out = two_ranks
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "prefixdpo train: error: optimizer step 2:" in line]
    # each rank prints its line, but once the first rank exits 2 torchrun tears the other down, which can cut
    # its line off (seen once in 7 full runs): at least one, at most one per rank
    assert 1 <= len(lines) <= 2, proc.stderr[-6000:]
    last = os.path.join(str(out), "cli", "checkpoint-1")
    assert all(f"Last good checkpoint: {last}." in line for line in lines)
    assert sorted(os.listdir(out / "cli")) == ["checkpoint-1"]
    assert all(torch.isfinite(t).all() for t in checkpoint_weights(last).values())


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_two_ranks_deepspeed_zero2_and_zero3(two_ranks):
    results = _cases(two_ranks, "zero2-stop-grad", "zero2-skip-loss", "zero3-stop-loss", "zero3-skip-grad")
    _assert_stopped_at_step_2(results["zero2-stop-grad"], "the gradient norm was not finite")
    _assert_skipped_step_2(results["zero2-skip-loss"])
    # the NaN loss reaches the gradients, so ZeRO-3's own check skips the step before the guard stops the run
    _assert_stopped_at_step_2(results["zero3-stop-loss"], "the loss of a micro-batch was nan on rank 1")
    _assert_skipped_step_2(results["zero3-skip-grad"])


# ---- pieces -----------------------------------------------------------------------------------------


def test_last_good_checkpoint_passes_over_nonfinite_and_torn_checkpoints(tmp_path):
    """The last good checkpoint is complete (its files as sealed) and had finite weights when saved (every rank
    checks what it holds: `PrefixTrainerBase._weights_finite`, FSDP/ZeRO shards included)."""
    def checkpoint(n, finite=True):
        staged = tmp_path / f"staged-{n}"
        staged.mkdir()
        save_file({"a": torch.ones(3)}, str(staged / "model.safetensors"))
        final = str(tmp_path / f"checkpoint-{n}")
        seal_checkpoint(str(staged), final, {"step": n, "run": None, "weights_finite": finite})
        return final

    assert last_good_checkpoint(str(tmp_path / "missing")) is None
    first = checkpoint(2)
    assert last_good_checkpoint(str(tmp_path)) == first
    checkpoint(3, finite=False)
    torn = checkpoint(11)
    data = open(os.path.join(torn, "model.safetensors"), "rb").read()
    open(os.path.join(torn, "model.safetensors"), "wb").write(data[: len(data) // 2])
    (tmp_path / "checkpoint-12").mkdir()  # no state file: not written (whole) by prefixdpo
    (tmp_path / "checkpoint-13.tmp-1-x").mkdir()  # not a checkpoint name
    assert last_good_checkpoint(str(tmp_path)) == first  # 12 no state, 11 torn, 3 non-finite
    ten = checkpoint(10)
    assert last_good_checkpoint(str(tmp_path)) == ten


@pytest.mark.parametrize("argv, message", [
    (["--nonfinite", "bogus"], "--nonfinite: invalid choice: 'bogus'"),
    (["--nonfinite_max_consecutive", "0"], "nonfinite_max_consecutive=0: expected a positive integer"),
])
def test_bad_options_are_one_line_config_errors(argv, message):
    for parse in (parse_train_args, parse_reward_args):
        with pytest.raises(ConfigError, match="^[^\n]*$") as err:
            parse(["--use_cpu", *argv])
        assert message in str(err.value)


def test_options_parse_from_yaml_and_python(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("nonfinite: skip\nnonfinite_max_consecutive: 3\n")
    for parse in (parse_train_args, parse_reward_args):
        cfg = parse([str(path), "--use_cpu", "--output_dir", str(tmp_path)])[0]
        assert (cfg.nonfinite, cfg.nonfinite_max_consecutive) == ("skip", 3)
        assert parse(["--use_cpu"])[0].nonfinite == "stop"
    for cls in (PrefixDPOConfig, PrefixRewardConfig):
        with pytest.raises(ConfigError, match="nonfinite='bogus': choose one of stop, skip"):
            cls(output_dir=str(tmp_path), use_cpu=True, nonfinite="bogus")
    from prefixdpo import cli

    assert cli.main(["train", "--nonfinite", "bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prefixdpo train: error:" in err[0] and "bogus" in err[0]


def test_engines_where_the_policy_cannot_hold_are_refused():
    args = SimpleNamespace(fp16=False, bf16=False, nonfinite="stop")
    assert deepspeed_gap({"zero_optimization": {"stage": 2}}, args) is None  # fp32: ZeRO refuses invalid norms
    assert deepspeed_gap({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, args) is None
    assert deepspeed_gap({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}},
                         SimpleNamespace(fp16=False, bf16=True)) is None  # check_grad_overflow defaults to true
    assert "check_grad_overflow" in deepspeed_gap(
        {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True, "check_grad_overflow": False}}, args)
    assert "without ZeRO" in deepspeed_gap({"zero_optimization": {"stage": 0}}, args)
    assert "compute_grad_norm" in deepspeed_gap({"zero_optimization": {"stage": 2, "compute_grad_norm": False}}, args)

    def trainer(ds_config=None, scaler=None, **kw):
        plugin = None if ds_config is None else SimpleNamespace(deepspeed_config=ds_config)
        accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), scaler=scaler)
        return SimpleNamespace(args=SimpleNamespace(**{**vars(args), **kw}), accelerator=accelerator)

    with pytest.raises(ConfigError, match="^nonfinite=stop: DeepSpeed without ZeRO in fp32 .*[^\n]$"):
        check_engine_support(trainer({"zero_optimization": {"stage": 0}}), "stop")
    with pytest.raises(ConfigError, match="^nonfinite=skip with fp16: fp16's loss scaler"):
        check_engine_support(trainer(fp16=True, scaler=torch.amp.GradScaler("cpu")), "skip")
    with pytest.raises(ConfigError, match="^nonfinite=skip with fp16"):  # DeepSpeed's fp16, "auto" from --fp16
        check_engine_support(trainer({"zero_optimization": {"stage": 2}, "fp16": {"enabled": "auto"}}, fp16=True),
                             "skip")
    check_engine_support(trainer(fp16=True, scaler=torch.amp.GradScaler("cpu")), "stop")  # stop: the loss is checked
    check_engine_support(trainer(fp16=True), "skip")  # fp16 without a loss scaler (CPU): ours to skip
    check_engine_support(trainer({"zero_optimization": {"stage": 3}}), "skip")
