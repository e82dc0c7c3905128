"""`PrefixRewardTrainer` end to end on tiny models: any layout of a step (unpacked, packed, accumulated, two
gloo ranks) gives the same losses and weights, and so does a step on tree lines (`prefix_tree`); resume equals an
uninterrupted run; evaluation; LoRA for sequence classification trains the score head; TRL's pad/EOS rules and
refusals."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import make_examples
from test_reward_scores import score_scale, tiny_reward_model
from prefixdpo import PrefixRewardConfig, PrefixRewardTrainer
from tolerances import K, K_FORWARD, assert_within, sgd_grad_scale, weights_scale


def config(tmp_path, name: str, **kw) -> PrefixRewardConfig:
    base = dict(output_dir=str(tmp_path / name), logging_steps=1, learning_rate=0.05, optim="sgd",
                lr_scheduler_type="constant", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                report_to="none", gradient_checkpointing=False, center_rewards_coefficient=0.01)
    base.update(kw)
    return PrefixRewardConfig(**base)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def assert_same_reward_log(a: dict, b: dict, model, k: float = K_FORWARD, k_grad: float = K, what: str = "") -> None:
    """Two logs of the same reward step agree (`tolerances`): mean/min/max reward within k eps x the scores' scale
    (`score_scale` of `model`); the margin (a mean of score differences) and the loss (slope <= 1 in each score of
    its pair, plus the centering term's 2 c |s_c + s_r|, c = 0.01) within twice that; grad_norm within k_grad eps
    x itself (a norm carries the rounding of the entries it sums)."""
    scores, largest = score_scale(model), max(abs(b["min_reward"]), abs(b["max_reward"]))
    for key in ("mean_reward", "min_reward", "max_reward"):
        assert_within(a[key], b[key], scores, k=k, what=f"{what} {key}")
    assert_within(a["margin"], b["margin"], 2 * scores, k=k, what=f"{what} margin")
    assert_within(a["loss"], b["loss"], 2 * scores * (1 + 0.04 * largest), k=k, what=f"{what} loss")
    if "grad_norm" in b:
        assert_within(a["grad_norm"], b["grad_norm"], b["grad_norm"], k=k_grad, what=f"{what} grad_norm")


def train(tmp_path, name, examples, **kw):
    trainer = PrefixRewardTrainer(model=tiny_reward_model("llama"), train_dataset=examples,
                                  args=config(tmp_path, name, **kw))
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


def test_every_layout_of_a_step_gives_the_same_step(tmp_path):
    """8 examples (K = 2 and 3, every pair best-vs-each) in one step: unpacked, packed, accumulated, and as
    standard rows. One large SGD step without clipping: (after - before) / lr is the gradient, with little
    weight rounding in it."""
    lr = 10.0
    examples = make_examples(8, ks=(2, 3))
    runs = {name: train(tmp_path, name, examples, max_steps=1, learning_rate=lr, max_grad_norm=0, **kw)
            for name, kw in {
                "unpacked": dict(per_device_train_batch_size=8),
                "packed": dict(per_device_train_batch_size=16, packing=True, pack_length=64),
                "accumulated": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
                "standard rows": dict(per_device_train_batch_size=8, prefix_sharing=False),
            }.items()}
    start = flat(tiny_reward_model("llama"))
    base_trainer, (base_log,) = runs["unpacked"]
    base_grad = (start - flat(base_trainer.model)) / lr
    assert base_grad.abs().max().item() > 1e-3
    for name, (trainer, (log,)) in runs.items():
        assert_same_reward_log(log, base_log, base_trainer.model, what=name)
        grad = (start - flat(trainer.model)) / lr
        assert_within(grad, base_grad, sgd_grad_scale(base_grad, start, lr), what=f"{name} gradient")


def test_one_step_on_tree_lines_equals_standard_rows(tmp_path):
    """prefix_tree: records sharing a prompt (three per prompt), records behind one system prompt and dialogues (each
    turn's prompt holding the earlier turns), each with its own margin, as packed token tries in one micro-batch of
    several lines, vs every `[prompt][response]` its own row: the logged step and the gradient (one large SGD
    step, as above) within 1e-5."""
    from test_tree import depth_1, depth_2, dialogue

    g = random.Random(0)
    records = dialogue(g, 3) + depth_1(g) + depth_2(g)
    examples = [dataclasses.replace(ex, source_index=i, meta={"margin": 0.25 * (i % 3)})
                for i, ex in enumerate(records)]
    lr, n = 10.0, len(examples)
    step = dict(max_steps=1, learning_rate=lr, max_grad_norm=0, per_device_train_batch_size=n)
    tree, (t_log,) = train(tmp_path, "tree", examples, packing=True, prefix_tree=True, pack_length=64, **step)
    standard, (s_log,) = train(tmp_path, "standard", examples, prefix_sharing=False, **step)
    (micro,) = tree._train_micro
    assert micro.batch.input_ids.shape[0] >= 2  # several tree lines, in one micro-batch
    assert micro.shared_tokens < 0.8 * sum(ex.shared_length for ex in examples)  # tries share across records
    assert_same_reward_log(t_log, s_log, standard.model, what="tree")
    start = flat(tiny_reward_model("llama"))
    t_grad, s_grad = ((start - flat(t.model)) / lr for t in (tree, standard))
    assert s_grad.abs().max().item() > 1e-3
    assert_within(t_grad, s_grad, sgd_grad_scale(s_grad, start, lr), what="gradient")


def test_resume_equals_an_uninterrupted_run(tmp_path):
    examples = make_examples(8, ks=(2, 3))
    kw = dict(per_device_train_batch_size=3, max_steps=4, save_strategy="steps", save_steps=2)  # crosses an epoch
    whole, whole_logs = train(tmp_path, "whole", examples, **kw)
    first = PrefixRewardTrainer(model=tiny_reward_model("llama"), train_dataset=examples,
                                args=config(tmp_path, "parts", **{**kw, "max_steps": 2}))
    first.train()
    second = PrefixRewardTrainer(model=tiny_reward_model("llama"), train_dataset=examples,
                                 args=config(tmp_path, "parts", **kw))
    second.train(resume_from_checkpoint="latest")
    resumed = [h for h in second.state.log_history if "loss" in h]
    assert [h["step"] for h in resumed[-2:]] == [3, 4]
    for a, b in zip(whole_logs[2:], resumed[-2:]):  # the same computations: equal to a few ulps
        assert_same_reward_log(b, a, whole.model, k_grad=K_FORWARD, what=f"step {a['step']}")
    start = flat(tiny_reward_model("llama"))
    assert_within(flat(second.model), flat(whole.model), weights_scale(start, flat(whole.model)), k=K_FORWARD,
                  what="resumed weights")


def test_evaluation_and_saved_model(tmp_path):
    from transformers import AutoModelForSequenceClassification

    examples = make_examples(6, ks=(2, 4))
    trainer = PrefixRewardTrainer(model=tiny_reward_model("qwen2"), train_dataset=examples, eval_dataset=examples,
                                  args=config(tmp_path, "eval", per_device_eval_batch_size=4, max_steps=1))
    metrics = trainer.evaluate()
    pairs = sum(len(ex.pairs) for ex in examples)
    assert set(metrics) >= {"eval_loss", "eval_accuracy", "eval_margin", "eval_mean_reward", "eval_min_reward",
                            "eval_max_reward"}
    assert metrics["eval_min_reward"] <= metrics["eval_mean_reward"] <= metrics["eval_max_reward"]
    assert round(metrics["eval_accuracy"] * pairs) == pytest.approx(metrics["eval_accuracy"] * pairs, abs=1e-9)
    trainer.save_model()
    saved = AutoModelForSequenceClassification.from_pretrained(trainer.args.output_dir)  # stock attention name
    assert saved.config.num_labels == 1 and saved.config._attn_implementation == "sdpa"


def test_lora_for_sequence_classification_trains_the_score_head(tmp_path):
    from peft import LoraConfig

    trainer = PrefixRewardTrainer(model=tiny_reward_model("llama"), train_dataset=make_examples(4),
                                  peft_config=LoraConfig(task_type="SEQ_CLS", r=4, target_modules="all-linear"),
                                  args=config(tmp_path, "lora", max_steps=1, per_device_train_batch_size=4))
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in names) and any("score" in n and "lora" not in n for n in names)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before if "score" in n)


def test_pad_and_eos_tokens_follow_trl_and_bad_models_are_refused(tmp_path):
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
    from prefixdpo.errors import UserError

    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    model = tiny_reward_model("llama", vocab_size=len(tokenizer), pad_token_id=None)
    records = [{"prompt": "hello world", "chosen": " yes", "rejected": " no"}] * 2
    trainer = PrefixRewardTrainer(model=model, processing_class=tokenizer, train_dataset=records,
                                  args=config(tmp_path, "pad"))
    assert tokenizer.pad_token == tokenizer.eos_token  # TRL: no pad token -> the EOS token
    assert trainer.model.config.pad_token_id == tokenizer.eos_token_id
    with pytest.raises(UserError, match="pad_token='<nope>' is not a token"):
        PrefixRewardTrainer(model=model, processing_class=tokenizer, train_dataset=records,
                            args=config(tmp_path, "pad2", pad_token="<nope>"))
    with pytest.raises(UserError, match="num_labels=2"):
        PrefixRewardTrainer(model=tiny_reward_model("llama", num_labels=2), processing_class=tokenizer,
                            train_dataset=records, args=config(tmp_path, "labels"))


DDP_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import finish_ranks, make_examples
    from test_reward_scores import tiny_reward_model
    from prefixdpo import PrefixRewardConfig, PrefixRewardTrainer

    out = sys.argv[1]
    args = PrefixRewardConfig(output_dir=out, per_device_train_batch_size=2, num_train_epochs=2, logging_steps=1,
                              learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", save_strategy="no",
                              use_cpu=True, disable_tqdm=True, seed=0, report_to="none", ddp_backend="gloo",
                              gradient_checkpointing=False, center_rewards_coefficient=0.01, fsdp="full_shard auto_wrap",
                              fsdp_config={{"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}})
    t = PrefixRewardTrainer(model=tiny_reward_model("llama"), train_dataset=make_examples(7, ks=(2, 3)), args=args)
    t.train()
    logs = [h for h in t.state.log_history if "loss" in h]
    sharded = [type(p).__name__ == "DTensor" for p in t.model.parameters()]
    params = torch.cat([(p.full_tensor() if sharded[i] else p).detach().flatten()
                        for i, p in enumerate(t.model.parameters())])
    finish_ranks(int(os.environ.get("RANK", "0")), out, {{"logs": logs, "params": params.tolist(),
                 "sharded": sum(sharded), "all": len(sharded), "engine": t.engine_description}})
    """
)


def test_two_gloo_ranks_equal_one_process(tmp_path):
    """7 examples (K = 2 and 3), 2 epochs: 2 gloo ranks x 2 per step (one rank runs an empty slot in the last
    step of each epoch) against one process with 4 per step. The 2 ranks run FSDP2 (every parameter sharded,
    gathered only inside the wrapped forward): the score head runs there too, or its weight would be a shard."""
    script = tmp_path / "ddp_reward.py"
    script.write_text(DDP_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    # --standalone: a free port of its own (a fixed one collides with other distributed runs on the machine)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(tmp_path / "ddp")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads((tmp_path / "ddp" / "result.json").read_text())
    one, logs = train(tmp_path, "one", make_examples(7, ks=(2, 3)), per_device_train_batch_size=4, num_train_epochs=2)
    assert len(logs) == len(two["logs"]) == 4
    for a, b in zip(logs, two["logs"]):
        assert_same_reward_log(b, a, one.model, what=f"step {a['step']}")
        assert b["accuracy"] == a["accuracy"]  # a fraction of the same pairs: equal, as it was before
    start = flat(tiny_reward_model("llama"))
    assert_within(torch.tensor(two["params"]), flat(one.model), weights_scale(start, flat(one.model)),
                  what="weights")
    assert two["sharded"] == two["all"], two["engine"]  # FSDP2 sharded every parameter, the score head too


def test_a_step_builds_one_mask_per_micro_batch_and_counts_its_tokens(tmp_path, monkeypatch):
    """One mask per micro-batch (counted where the sdpa mask is made), and the MicroBatch Trainer hands over is
    the loader's, with its margins; `include_num_input_tokens_seen` counts every slot of the lines run."""
    from test_trainer import record_masks_and_micro_batches

    masks, made = record_masks_and_micro_batches(monkeypatch)
    seen = []

    class Recording(PrefixRewardTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append(inputs)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    examples = [dataclasses.replace(ex, meta={"margin": 0.5 * i}) for i, ex in enumerate(make_examples(4))]
    trainer = Recording(model=tiny_reward_model("llama"), train_dataset=examples,
                        args=config(tmp_path, "r", max_steps=1, per_device_train_batch_size=2,
                                    gradient_accumulation_steps=2, include_num_input_tokens_seen="all"))
    trainer.train()
    assert len(seen) == len(masks) == 2 and all(a is b for a, b in zip(seen, made))
    ids = [m.example_ids.tolist() for m in seen]
    assert [m.margins.tolist() for m in seen] == [[0.5 * e for e in pair] for pair in ids]  # one pair each
    assert trainer.state.num_input_tokens_seen == sum(m.slots for m in seen) > sum(m.real_tokens for m in seen)
