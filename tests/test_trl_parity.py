"""Reproducing a TRL run batch for batch: the training order (`train_sampling_strategy`) and per-step
metrics equal to TRL 1.16's `DPOTrainer` on the same records, model and optimizer.

TRL runs standard paired rows (`[prompt][chosen]` and `[prompt][rejected]` padded, stock SDPA
attention, its fused LM head); we run one prefix-shared row per example. Both are fp32 on CPU, so the
per-step metrics agree to float rounding (`compare`, from `tolerances`; K: the steps are Adam's): the loss and
rewards within K eps x beta x the step's log-prob sums' scale (a reward is beta x a difference of ~-40 sums, near 0:
its rounding is the sums', not its own size's), summed log-probs within K eps of their size, the gradient norm
within K eps of itself.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import make_examples, tiny_model
from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer
from prefixdpo.data.loader import LoaderSettings, MicroBatches, empty_batch, pack_in_order, plan_epoch
from prefixdpo.data.packing import RowTooLongError, plan_packs
from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer
from tolerances import bound, dpo_loss_scale

# ---------------------------------------------------------------------------------------------
# the sampling strategy, in the loader
# ---------------------------------------------------------------------------------------------


def flat(plan_rank) -> list[int]:
    """Example indices of one rank's plan in the order they are trained."""
    return [e for mb in plan_rank for line in mb for e in line]


def test_sequential_keeps_file_order_every_epoch_and_over_ranks():
    examples = make_examples(10)
    settings = LoaderSettings(batch_size=3, sequential=True, shuffle=True, seed=7)
    for epoch in (0, 1):
        (plan,) = plan_epoch(examples, settings, epoch, world_size=1)
        assert flat(plan) == list(range(10))
        assert [len(mb) for mb in plan] == [3, 3, 3, 1]
    # two ranks: micro-batch k of both ranks together is the k-th block of 2 x 3 examples, in file order
    plan = plan_epoch(examples, settings, 0, world_size=2)
    blocks = [sorted(e for r in range(2) for line in plan[r][k] for e in line) for k in range(len(plan[0]))]
    assert blocks == [list(range(0, 6)), list(range(6, 10))]
    # the default (random) is a seeded permutation, not file order
    (shuffled,) = plan_epoch(examples, LoaderSettings(batch_size=3, seed=7), 0, world_size=1)
    assert sorted(flat(shuffled)) == list(range(10)) and flat(shuffled) != list(range(10))


def test_sequential_packing_keeps_file_order():
    examples = make_examples(24)
    lengths = [ex.shared_length for ex in examples]
    pack = 48
    # best-fit packing, even unshuffled, places the longest rows first: it does not keep file order
    assert flat([plan_packs(lengths, pack, shuffle=False)]) != list(range(24))
    settings = LoaderSettings(batch_size=2, packing=True, pack_length=pack, sequential=True, shuffle=True)
    (plan,) = plan_epoch(examples, settings, 0, world_size=1)
    lines = [line for mb in plan for line in mb]
    assert [e for line in lines for e in line] == list(range(24))
    assert all(sum(lengths[e] for e in line) <= pack for line in lines)
    # each line closed only because the next example did not fit (fewest order-keeping lines)
    assert all(sum(lengths[e] for e in a) + lengths[b[0]] > pack for a, b in zip(lines, lines[1:]))
    assert len(lines) < 24  # something was packed together
    # the micro-batches hold their examples in file order too
    micro = MicroBatches(examples, settings)
    assert torch.cat([micro[m].example_ids for m in range(len(micro))]).tolist() == list(range(24))


def test_pack_in_order_names_a_row_too_long():
    assert pack_in_order([3, 2, 4, 1], 5) == [[0, 1], [2, 3]]
    with pytest.raises(RowTooLongError, match="row 2: length 9 exceeds pack_length 5"):
        pack_in_order([3, 2, 9], 5)


def test_empty_batch_weighs_nothing():
    batch = empty_batch(pad_token_id=5)
    assert batch.input_ids.tolist() == [[5]] and batch.num_pairs == 0 and batch.num_responses == 0
    assert batch.num_real_tokens == 1  # the one token is a document, so it attends to itself


def test_trainer_honours_train_sampling_strategy(tmp_path):
    examples = make_examples(12)
    for strategy, packing in (("sequential", False), ("sequential", True), ("random", True)):
        args = PrefixDPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2,
                               packing=packing, pack_length=64 if packing else "auto",
                               train_sampling_strategy=strategy)
        trainer = PrefixDPOTrainer(model=tiny_model("llama"), args=args, train_dataset=examples)
        trainer.get_train_dataloader()
        order = flat(trainer._train_micro.plan[0])
        assert sorted(order) == list(range(12))
        assert (order == list(range(12))) == (strategy == "sequential"), (strategy, packing, order)


# ---------------------------------------------------------------------------------------------
# per-step equality with TRL 1.16's DPOTrainer
# ---------------------------------------------------------------------------------------------

WORDS = ("the quick brown fox jumps over lazy dog what is capital of France Paris bake bread flour water "
         "salt yeast hello world help").split()
MOVED = 5e-4  # |rewards/margins| of a policy that training moved from its reference: far above any rounding


def parity_records(n: int = 16, seed: int = 0) -> list[dict]:
    """Short standard records (prompt 8-20 tokens, responses 2-10 tokens): nothing is ever truncated."""
    g = random.Random(seed)

    def text(k):
        return " ".join(g.choice(WORDS) for _ in range(k))

    return [{"prompt": f"Question {i}: {text(g.randrange(3, 12))}? Answer:",
             "chosen": f" {text(g.randrange(1, 6))}.", "rejected": f" {text(g.randrange(1, 6))}."} for i in range(n)]


def shared_options(tmp_path, name: str, batch_size: int, grad_accum: int) -> dict:
    """Every option TRL's DPOConfig defaults differently from us (bf16, gradient checkpointing, learning rate,
    logging, truncation), set identically on both sides."""
    return dict(
        output_dir=str(tmp_path / name), per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum, num_train_epochs=1, train_sampling_strategy="sequential",
        learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", weight_decay=0.0,
        max_grad_norm=1.0, logging_steps=1, seed=0, data_seed=0, bf16=False, fp16=False,
        gradient_checkpointing=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
        beta=0.1, loss_type=["sigmoid"], loss_weights=None, label_smoothing=0.0, precompute_ref_log_probs=False,
        disable_dropout=True, max_length=512, truncation_mode="keep_start",
    )


def step_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def run_trl(records, tokenizer, base, options):
    """TRL 1.16 DPOTrainer; returns (per-step logs, per-micro-batch lists of prompt+chosen token ids)."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    seen: list[list[list[int]]] = []

    class Recording(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
            chosen = ids.shape[0] // 2  # TRL stacks [chosen rows; rejected rows]
            seen.append([ids[i][mask[i]].tolist() for i in range(chosen)])
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = DPOConfig(padding_free=False, pad_to_multiple_of=None, use_weighting=False, ld_alpha=None,
                     f_divergence_type="reverse_kl", sync_ref_model=False, **options)
    trainer = Recording(model=copy.deepcopy(base), ref_model=copy.deepcopy(base), args=args,
                        train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer)
    trainer.train()
    return step_logs(trainer), seen


def run_ours(records, tokenizer, base, options):
    """PrefixDPOTrainer, prefix sharing on, packing off; returns (per-step logs, per-micro-batch prompt+chosen ids)."""
    seen: list[list[list[int]]] = []

    class Recording(PrefixDPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            exs = [self.train_dataset[e] for e in inputs.micro.example_ids.tolist()]
            seen.append([list(ex.prompt_ids) + list(ex.response_ids[0]) for ex in exs])
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = PrefixDPOConfig(prefix_sharing=True, packing=False, attention="sdpa", **options)
    trainer = Recording(model=copy.deepcopy(base), ref_model=copy.deepcopy(base), args=args,
                        train_dataset=records, processing_class=tokenizer)
    assert trainer.data_reports["train"].truncated == 0 and trainer.data_reports["train"].dropped == 0
    assert all(ex.pairs == ((0, 1),) for ex in trainer.train_dataset)  # response 0 = chosen
    trainer.train()
    return step_logs(trainer), seen


def parity_setup(arch: str = "llama", **overrides):
    """(16 records, the tiny tokenizer, a tiny model of `arch`) with TRL's and datasets' progress output off."""
    pytest.importorskip("trl")
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    tokenizer = build_tiny_tokenizer()
    return parity_records(16), tokenizer, tiny_model(arch, vocab_size=len(tokenizer), **overrides)


def compare(trl_logs, our_logs, beta: float = 0.1) -> tuple[list[bool], str]:
    """Per step (`tolerances`; K, as after Adam steps): the loss and rewards within K eps x `dpo_loss_scale` of
    TRL's step, log-probs within K eps of their size, grad_norm within K eps of itself; and a side-by-side table
    (with each bound) for the failure message."""
    rows = []
    for step, (t, o) in enumerate(zip(trl_logs, our_logs), start=1):
        scales = {key: dpo_loss_scale(t, beta) for key in ("loss", "rewards/chosen", "rewards/rejected",
                                                           "rewards/margins")}
        scales.update({key: abs(t[key]) for key in ("logps/chosen", "logps/rejected")})
        for key, scale in scales.items():
            rows.append((step, key, t[key], o[key], bound(scale)))
        rows.append((step, "grad_norm", t["grad_norm"], o["grad_norm"], bound(t["grad_norm"])))
    table = "\n".join(f"step {s} {k:17s} trl {a: .8f} ours {b: .8f} diff {a - b: .2e} bound {c:.2e}"
                      for s, k, a, b, c in rows)
    return [abs(a - b) <= c for _, _, a, b, c in rows], table


# With accumulation TRL averages micro-batch means, we average the step's pairs: equal here because
# every micro-batch holds the same number of pairs (16 records split evenly).
@pytest.mark.parametrize("batch_size,grad_accum", [(4, 1), (2, 2)])
def test_per_step_metrics_equal_trl_dpo_trainer(tmp_path, batch_size, grad_accum):
    records, tokenizer, base = parity_setup()
    options = shared_options(tmp_path, "run", batch_size, grad_accum)
    trl_logs, trl_batches = run_trl(records, tokenizer, base, {**options, "output_dir": str(tmp_path / "trl")})
    our_logs, our_batches = run_ours(records, tokenizer, base, {**options, "output_dir": str(tmp_path / "ours")})

    # the same records, micro-batch for micro-batch, in file order; every optimizer step a different batch
    assert len(our_batches) == len(trl_batches) == 16 // batch_size
    differ = [m for m, (a, b) in enumerate(zip(our_batches, trl_batches)) if a != b]
    assert not differ, f"micro-batches {differ} hold other records than TRL's (sampling order not sequential?)"
    steps = [sum(trl_batches[s : s + grad_accum], []) for s in range(0, len(trl_batches), grad_accum)]
    assert len(steps) == len(trl_logs) == len(our_logs) == 4
    assert len({tuple(map(tuple, step)) for step in steps}) == 4

    oks, table = compare(trl_logs, our_logs)
    assert all(oks), table
    # training moved the policy away from the reference: the rewards are not trivially zero after step 1
    assert all(abs(o["rewards/margins"]) > MOVED for o in our_logs[1:]), table
