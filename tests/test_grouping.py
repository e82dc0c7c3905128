"""`group_by_prompt`: records with the same prompt tokens become one row with K responses.

What it must keep: every pair the records name (a pair two records name: twice), each pair's loss and log-prob
sums equal to its ungrouped ones (fp32, 1e-6 x the log-prob scale: the same sums from a differently laid out
pass, whose own rounding is that sums' ulp), each pair's reward margin;
with the option off, the trainer's examples and plans are today's, untouched. One optimizer step on an SHP-like
file (a post, several comment pairs per post, each pair its own record) grouped and prefix-shared equals
standard DPO (every `[prompt][response]` its own row, nothing grouped) over the same pairs in one step
(`tolerances`): loss within beta x the log-prob sums' scale, gradients within their largest entry's. About 25 s
on 2 busy CPU cores.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import tiny_model
from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer, PrefixRewardConfig, PrefixRewardTrainer
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo.data.grouping import PAIR_RECORDS, group_by_prompt
from prefixdpo.data.loader import pair_margins
from prefixdpo.dpo.loss_table import LossParams
from prefixdpo.dpo.reference import SeparateModelReference
from prefixdpo.dpo.step import Objective, pair_losses
from prefixdpo.errors import ConfigError
from test_reward_scores import tiny_reward_model
from test_reward_trainer import assert_same_reward_log
from tolerances import assert_logged_loss_within, assert_within, dpo_loss_scale, in_dtype, sgd_grad_scale


def shp_like(posts: int, seed: int = 0, vocab: int = 96) -> list[Example]:
    """Records of `posts` posts (prompts of 6-12 tokens), each with 3-5 comments (2-7 tokens) and 3-6 comment
    pairs, one pair per record, the posts' records shuffled together (as a file of pairs lists them)."""
    g = random.Random(seed)
    records = []
    for _ in range(posts):
        prompt = [g.randrange(3, vocab) for _ in range(g.randrange(6, 13))]
        comments = [[g.randrange(3, vocab) for _ in range(g.randrange(2, 8))] for _ in range(g.randrange(3, 6))]
        candidates = [(i, j) for i in range(len(comments)) for j in range(len(comments)) if i != j]
        for i, j in g.sample(candidates, g.randrange(3, 7)):
            records.append((prompt, [comments[i], comments[j]]))
    g.shuffle(records)
    return [Example(p, rs, ((0, 1),), index) for index, (p, rs) in enumerate(records)]


def test_grouping_merges_same_prompts_and_keeps_every_pair():
    a, b, c = (3, 4), (5,), (6, 7, 8)
    examples = [
        Example((1, 2), (a, b), ((0, 1),), 0, {"margin": 0.5}),
        Example((9,), (a, b), ((1, 0),), 1),
        Example((1, 2), (c, a, b), ((0, 1), (0, 2)), 2, {"margin": 1.5, "format": "multi_response"}),
        Example((1, 2), (b, a), ((1, 0),), 3, {"format": "standard"}),  # the same pair as record 0, named again
    ]
    grouped, report = group_by_prompt(examples)
    first, other = grouped
    assert other is examples[1]  # a prompt no other record shares: the example itself
    assert first.response_ids == (a, b, c) and first.pairs == ((0, 1), (2, 0), (2, 1), (0, 1))
    assert first.meta[PAIR_RECORDS] == (0, 2, 2, 3) and first.meta["records"] == (0, 2, 3)
    assert "format" not in first.meta  # reporting-only metadata does not travel
    assert pair_margins(grouped).tolist() == [0.5, 1.5, 1.5, 0.0, 0.0]  # per pair; 0 where a record had none
    assert (report.examples_in, report.examples_out, report.groups, report.pairs) == (4, 2, 1, 5)
    assert report.responses_in - report.responses_out == 4
    assert report.tokens_out == (2 + 2 + 1 + 3) + (1 + 2 + 1)
    assert "4 examples -> 2 rows" in report.summary()

    # cut to a row length: each part repeats the prompt, in record order, every pair still there
    longer = examples + [Example((1, 2), ((9, 9), b), ((0, 1),), 4)]
    parts, report = group_by_prompt(longer, max_row_length=2 + 2 + 1 + 3)
    assert [ex.meta.get(PAIR_RECORDS, (ex.source_index,)) for ex in parts] == [(0, 2, 2, 3), (4,), (1,)]
    assert report.split == 1 and "split" in report.summary()


def test_metadata_that_cannot_merge_keeps_a_record_apart_and_counts_it():
    examples = [Example((1, 2), ((3,), (4,)), ((0, 1),), 7, {"source": "a"}),
                Example((1, 2), ((5,), (4,)), ((0, 1),), 8, {"source": "b"}),
                Example((1, 2), ((6,), (4,)), ((0, 1),), 9, {"source": "a"})]
    grouped, report = group_by_prompt(examples)
    assert [ex.meta.get("records", (ex.source_index,)) for ex in grouped] == [(7, 9), (8,)]
    assert report.kept_apart == 1
    assert "record 8: meta 'source' differs from record 7's" in report.summary()


def test_a_pair_of_two_equal_responses_stays_a_pair():
    """Two responses cut to the same tokens (truncation) are a pair of equal sequences: still two responses."""
    examples = [Example((1,), ((3, 4), (3, 4)), ((0, 1),), 0), Example((1,), ((3, 4), (5,)), ((0, 1),), 1)]
    (grouped,), _ = group_by_prompt(examples)
    assert grouped.response_ids == ((3, 4), (3, 4), (5,)) and grouped.pairs == ((0, 1), (0, 2))


def _losses_by_record_pair(examples, losses) -> dict:
    """{(record, k): loss of the record's k-th pair} from a batch's per-pair losses (example order)."""
    out, seen = {}, {}
    records = [r for ex in examples for r in ex.meta.get(PAIR_RECORDS, (ex.source_index,) * len(ex.pairs))]
    for record, loss in zip(records, losses.tolist()):
        k = seen[record] = seen.get(record, -1) + 1
        out[(record, k)] = loss
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_grouped_pair_losses_equal_the_ungrouped_ones(packed):
    """Every pair's combined loss (sigmoid + ipo + hinge, a reference model that is not the policy) from grouped
    rows equals its loss from the records' own rows, fp32 1e-6."""
    examples = shp_like(5)
    grouped, report = group_by_prompt(examples)
    assert report.examples_out == 5 and report.responses_out < report.responses_in
    policy, ref = tiny_model("llama"), tiny_model("llama")
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9)
    reference = SeparateModelReference(ref, backend="sdpa")
    objective = Objective(("sigmoid", "ipo", "hinge"), (1.0, 0.5, 0.25), LossParams(beta=0.5))

    def per_pair(exs):
        packs = [list(range(len(exs)))] if packed else None
        batch = build_batch(exs, prefix_sharing=True, packs=packs)
        step = pair_losses(policy, batch, plan_pass(batch, "sdpa"), reference=reference,
                           objective=objective)
        return {name: _losses_by_record_pair(exs, values.detach()) for name, values in
                (("loss", step.losses), ("chosen", step.pairs.policy_chosen_logps),
                 ("rejected", step.pairs.policy_rejected_logps))}

    alone, together = per_pair(examples), per_pair(grouped)
    assert alone["loss"].keys() == together["loss"].keys() and len(alone["loss"]) == len(examples)
    # fp32 sums of ~40 carry ~4e-6 of rounding (their ulp) whatever the layout: the tolerance is 1e-6 of that scale
    scale = max(1.0, *(abs(v) for name in ("chosen", "rejected") for v in alone[name].values()))
    for name in ("loss", "chosen", "rejected"):
        assert max(abs(alone[name][k] - together[name][k]) for k in alone[name]) <= 1e-6 * scale, name
    assert max(alone["loss"].values()) - min(alone["loss"].values()) > 0.1  # the pairs' losses really differ


def _dpo_config(tmp_path, name, **kw) -> PrefixDPOConfig:
    base = dict(output_dir=str(tmp_path / name), max_steps=1, logging_steps=1, learning_rate=10.0, optim="sgd",
                lr_scheduler_type="constant", max_grad_norm=0, save_strategy="no", use_cpu=True, disable_tqdm=True,
                seed=0, beta=0.5, report_to="none", gradient_checkpointing=False, precompute_ref_log_probs=False)
    base.update(kw)
    return PrefixDPOConfig(**base)


def one_dpo_step(tmp_path, path: str, tokenizer, name: str, dtype: torch.dtype = torch.float32, **options):
    """(trainer, its one logged step) of one SGD step on the file `path` from the tiny Llama every run starts from
    (`tiny_model`'s seed; in `dtype`, `tolerances.in_dtype`), with a reference that is not the policy (its weights
    x 0.9)."""
    vocab = len(tokenizer)
    ref = in_dtype(tiny_model("llama", vocab_size=vocab), dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9)
    trainer = PrefixDPOTrainer(model=in_dtype(tiny_model("llama", vocab_size=vocab), dtype), ref_model=ref,
                               args=_dpo_config(tmp_path, name, **options), train_dataset=path,
                               processing_class=tokenizer)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    return trainer, log


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def assert_same_dpo_step(a: tuple, b: tuple, start: torch.Tensor, beta: float, dtype: torch.dtype = torch.float32,
                         lr: float = 10.0) -> float:
    """Two runs' (logged step, trained weights [N]) of one SGD step of `lr` from `start` [N] took the same step
    (`tolerances`): the logged loss within the rule for beta x its log-prob sums' scale
    (`assert_logged_loss_within`), the gradients (start - trained) / lr within it for their largest entry, which is
    not tiny. Returns the gradients' difference in eps x scale."""
    (a_log, a_w), (b_log, b_w) = a, b
    assert_logged_loss_within(a_log["loss"], b_log["loss"], dpo_loss_scale(b_log, beta), dtype)
    assert a_log["loss"] != pytest.approx(0.6931, abs=1e-3)  # the reference differs from the policy
    a_grad, b_grad = ((start - w) / lr for w in (a_w, b_w))
    assert b_grad.abs().max().item() > 1e-4
    return assert_within(a_grad, b_grad, sgd_grad_scale(b_grad, start, lr), dtype, what="gradient")


def _shp_file(tmp_path, posts: int = 4, seed: int = 0) -> tuple[str, int]:
    """An SHP-like JSONL file (standard records: a post, two of its comments) and its number of records."""
    g = random.Random(seed)
    words = "the cat dog sat ran on a mat hat big small red blue why how it is was not".split()
    records = []
    for post in range(posts):
        prompt = f"POST {post}: " + " ".join(g.choice(words) for _ in range(g.randrange(8, 16))) + "\nCOMMENT:"
        comments = [" " + " ".join(g.choice(words) for _ in range(g.randrange(2, 8))) for _ in range(4)]
        for i, j in g.sample([(i, j) for i in range(4) for j in range(4) if i != j], g.randrange(3, 6)):
            records.append({"prompt": prompt, "chosen": comments[i], "rejected": comments[j]})
    g.shuffle(records)
    path = tmp_path / "shp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path), len(records)


def test_one_step_on_an_shp_like_file_equals_standard_dpo(tmp_path):
    """The file's pairs grouped (one row per post, packed) vs standard DPO (two `[prompt][response]` rows per
    record, nothing shared), all pairs in one SGD step, a reference that is not the policy."""
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    path, n_records = _shp_file(tmp_path)
    tokenizer = build_tiny_tokenizer()
    start = tiny_model("llama", vocab_size=len(tokenizer))
    grouped, g_log = one_dpo_step(tmp_path, path, tokenizer, "grouped", group_by_prompt=True, packing=True,
                                  per_device_train_batch_size=4)
    standard, s_log = one_dpo_step(tmp_path, path, tokenizer, "standard", prefix_sharing=False,
                                   per_device_train_batch_size=n_records)
    report = grouped.group_reports["train"]
    assert report.examples_out == 4 and report.pairs == n_records  # one row per post, every pair
    assert_same_dpo_step((g_log, _flat(grouped.model)), (s_log, _flat(standard.model)), _flat(start), beta=0.5)
    assert g_log["prefix_sharing/tokens_saved"] > 0.5 > s_log["prefix_sharing/tokens_saved"]


def test_reward_step_grouped_with_margins_equals_the_standard_step(tmp_path):
    """Reward model: each record's margin stays with its pair; one grouped step == one standard-rows step."""
    examples = [Example(ex.prompt_ids, ex.response_ids, ex.pairs, ex.source_index, {"margin": 0.25 * (i % 4)})
                for i, ex in enumerate(shp_like(4, seed=1))]
    start = _flat(tiny_reward_model("llama"))
    runs = {}
    for name, kw in {"grouped": dict(group_by_prompt=True, per_device_train_batch_size=4),
                     "standard": dict(prefix_sharing=False, per_device_train_batch_size=len(examples))}.items():
        args = PrefixRewardConfig(output_dir=str(tmp_path / name), max_steps=1, logging_steps=1, learning_rate=10.0,
                                  optim="sgd", lr_scheduler_type="constant", max_grad_norm=0, save_strategy="no",
                                  use_cpu=True, disable_tqdm=True, seed=0, report_to="none",
                                  gradient_checkpointing=False, center_rewards_coefficient=0.01, **kw)
        trainer = PrefixRewardTrainer(model=tiny_reward_model("llama"), args=args, train_dataset=examples)
        trainer.train()
        runs[name] = trainer, [h for h in trainer.state.log_history if "loss" in h][0]
    (g, g_log), (s, s_log) = runs["grouped"], runs["standard"]
    assert len(g.train_dataset) == 4
    assert_same_reward_log(g_log, s_log, s.model, what="grouped")
    g_grad, s_grad = ((start - _flat(t.model)) / 10.0 for t in (g, s))
    assert s_grad.abs().max().item() > 1e-4
    assert_within(g_grad, s_grad, sgd_grad_scale(s_grad, start, 10.0), what="gradient")


def test_grouping_off_leaves_the_examples_and_plans_as_they_are(tmp_path):
    """Off (the default): the trainer's examples are the ones given, in order, so every plan and number is
    today's; on, the same data runs as fewer rows holding the same pairs."""
    examples = shp_like(4)
    off = PrefixDPOTrainer(model=tiny_model("llama"), args=_dpo_config(tmp_path, "off", per_device_train_batch_size=2),
                           train_dataset=examples)
    assert PrefixDPOConfig(output_dir=str(tmp_path)).group_by_prompt is False
    assert all(a is b for a, b in zip(off.train_dataset, examples)) and len(off.train_dataset) == len(examples)
    assert off.group_reports == {}
    on = PrefixDPOTrainer(model=tiny_model("llama"),
                          args=_dpo_config(tmp_path, "on", per_device_train_batch_size=2, group_by_prompt=True),
                          train_dataset=examples)
    assert len(on.train_dataset) == 4
    assert sum(len(ex.pairs) for ex in on.train_dataset) == len(examples)


def test_group_by_prompt_needs_prefix_sharing_and_is_a_command_line_option(tmp_path):
    from prefixdpo.commands.reward import parse_reward_args
    from prefixdpo.commands.train import parse_train_args

    with pytest.raises(ConfigError, match="group_by_prompt=true needs prefix_sharing=true"):
        PrefixDPOConfig(output_dir=str(tmp_path), group_by_prompt=True, prefix_sharing=False)
    config, *_ = parse_train_args(["--output_dir", str(tmp_path), "--group_by_prompt", "true"])
    assert config.group_by_prompt is True
    config, *_ = parse_reward_args(["--output_dir", str(tmp_path), "--group_by_prompt"])
    assert config.group_by_prompt is True


def test_stats_and_inspect_report_sharing_and_grouping_apart(tmp_path, capsys):
    """3 records of one prompt (10 tokens; responses a, b, c of 5 tokens; pairs ab, ac, bc) and one other record:
    per-record sharing runs 4 x 20 tokens of standard DPO's 4 x 30; grouped, the prompt's 3 records are one row of
    10 + 15 tokens. The FLOP model's speedups: std / per-record rows, std / grouped rows."""
    from prefixdpo_tools.bench.flops import ModelShape, ideal_speedup
    from prefixdpo.cli import main
    from prefixdpo.data.stats import compute_stats
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    shape = ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256)
    prompt, (a, b, c) = tuple(range(1, 11)), ((7,) * 5, (8,) * 5, (9,) * 5)
    examples = [Example(prompt, r, ((0, 1),), i) for i, r in enumerate(((a, b), (a, c), (b, c)))]
    examples.append(Example(tuple(range(20, 30)), (a, b), ((0, 1),), 3))
    grouped, _ = group_by_prompt(examples)
    per_record, with_groups = ideal_speedup(shape, examples), ideal_speedup(shape, examples, shared_rows=grouped)
    stats = compute_stats(examples, 64, speedup=per_record, model_name="tiny", grouped=grouped,
                          grouped_speedup=with_groups)
    assert (stats.shared_tokens, stats.unshared_tokens, stats.grouped_rows, stats.grouped_tokens) == (80, 120, 2, 45)
    assert stats.grouping_saving == pytest.approx(1 - 45 / 80) and with_groups > per_record > 1
    text = stats.format()
    assert "33.3% vs standard DPO by per-record sharing" in text
    assert "43.8% more by group_by_prompt (4 records -> 2 rows, 45 tokens): 62.5% vs standard DPO in all" in text
    assert f"{with_groups:.2f}x with group_by_prompt ({with_groups / per_record:.2f}x from grouping alone)" in text

    tokenizer_dir = tmp_path / "tok"
    build_tiny_tokenizer().save_pretrained(str(tokenizer_dir))
    path, n_records = _shp_file(tmp_path)
    assert main(["inspect", path, "--tokenizer", str(tokenizer_dir)]) == 0
    out = capsys.readouterr().out
    assert f"more by group_by_prompt ({n_records} records -> 4 rows" in out and "from grouping alone" in out
    # records behind one system prompt: grouping saves nothing, a token trie shares the system prompt per line
    system = tmp_path / "system.jsonl"
    system.write_text("".join(json.dumps({"prompt": f"SYSTEM: answer briefly and kindly. USER: question {i}?",
                                          "chosen": " yes", "rejected": " no"}) + "\n" for i in range(6)))
    png = tmp_path / "mask.png"
    assert main(["inspect", str(system), "--tokenizer", str(tokenizer_dir), "--show-mask", str(png)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "mask-trie.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "token-trie line" in out
    assert "0.0% more by group_by_prompt (6 records -> 6 rows" in out
    trie_line = next(line for line in out.splitlines() if "more by a token trie across records" in line)
    assert float(trie_line.split("%")[0]) > 30 and "with a token trie across records" in out


def test_a_group_too_long_for_an_explicit_pack_length_is_split_and_trains(tmp_path):
    """pack_length = the longest record's row: every record fits, some posts' grouped rows do not; they are split,
    each part repeating the prompt, and the packed run takes all pairs."""
    examples = shp_like(4)
    longest = max(ex.shared_length for ex in examples)
    assert max(ex.shared_length for ex in group_by_prompt(examples)[0]) > longest
    trainer = PrefixDPOTrainer(model=tiny_model("llama"), train_dataset=examples,
                               args=_dpo_config(tmp_path, "split", group_by_prompt=True, packing=True,
                                                pack_length=longest, per_device_train_batch_size=64))
    report = trainer.group_reports["train"]
    assert report.split >= 1 and report.examples_out > 4
    assert max(ex.shared_length for ex in trainer.train_dataset) <= longest
    assert sum(len(ex.pairs) for ex in trainer.train_dataset) == len(examples)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert log["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference at the first step: every pair's log 2
