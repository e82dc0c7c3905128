"""`prefix_tree=true`: DPO training on packed lines that are token tries across records (`data.tree`; reward
models: tests/test_reward_trainer.py).

What it must keep: every example in exactly one line, each line's trie within pack_length, the records of one
subtree side by side (a subtree too big for a line split, each part repeating the shared prefix, counted); every
pair's loss and log-prob sums from the loader's tree lines equal to its own prefix-shared row's (8 eps x the
log-prob scale: fp32 1e-6), on the dense SDPA mask and on the segment plan (and in float64). One optimizer step on
a 3-turn dialogue file (a pair at each turn, each later turn's prompt holding the earlier turns, all behind one
system prompt) and on an SHP-like file (several comment pairs per post, one record each) with tries equals
standard DPO (every `[prompt][response]` its own row) over the same pairs in one step (`tolerances`: loss within
beta x the log-prob sums' scale, gradients within their largest entry's; one float64 run), and the trained weights
evaluate the same on tree lines as on standard rows. The MoE load-balancing loss on tree lines (each node weighted
by the TRL rows through it) equals TRL's own on its padded rows (within its own O(1) scale), and one DPO step with
it on tries equals one without tries. Tries without packing (or without prefix sharing) are refused in one line.
About 40 s on 2 busy CPU cores.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from conftest import tiny_model
from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer, PrefixRewardConfig
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo.data.loader import LoaderSettings, MicroBatches
from prefixdpo.core.forward import compute_response_logps
from prefixdpo.core.moe import recording_router_logits, trl_token_multiplicity
from prefixdpo.data.tree import build_tree_batch, plan_tree_lines, tree_line
from prefixdpo.dpo.loss_table import LossParams
from prefixdpo.dpo.reference import SeparateModelReference
from prefixdpo.dpo.step import Objective, pair_losses
from prefixdpo.errors import ConfigError
from test_grouping import _dpo_config, _flat, _shp_file, assert_same_dpo_step, one_dpo_step
from test_tree import _ids, depth_1, depth_2, dialogue
from test_trl_options import MOE, trl_rows
from tolerances import K_FORWARD, assert_within, dpo_loss_scale, in_dtype


def _system_prompted(g: random.Random, system: tuple[int, ...], prompts: int) -> list[Example]:
    """`prompts` prompts behind `system`, two records each (K = 2)."""
    out = []
    for _ in range(prompts):
        prompt = system + _ids(g, g.randrange(3, 7))
        out += [Example(prompt, (_ids(g, 3), _ids(g, 4)), ((0, 1),)) for _ in range(2)]
    return out


def test_plan_places_subtrees_whole_and_splits_a_too_big_one_repeating_its_prefix():
    g = random.Random(0)
    system = _ids(g, 10)
    examples = dialogue(g, 3) + _system_prompted(g, system, 3) + dialogue(g, 2)
    examples = [Example(ex.prompt_ids, ex.response_ids, ex.pairs, i) for i, ex in enumerate(examples)]
    g.shuffle(examples)
    for pack_length in (45, 60, 400):
        plan = plan_tree_lines(examples, pack_length)
        assert sorted(e for line in plan.lines for e in line) == list(range(len(examples)))
        sizes = [len(tree_line([examples[e] for e in line])) for line in plan.lines]
        assert max(sizes) <= pack_length
        if pack_length == 400:  # one line: the trie of everything, nothing repeated
            assert len(plan.lines) == 1 and plan.splits == plan.repeated_tokens == 0
            assert sizes[0] < sum(ex.shared_length for ex in examples)
    # 60: the system prompt's subtree (6 records) does not fit one line: it is cut between its prompts, each part
    # repeating the 10 system tokens; each prompt's two records stay together
    plan = plan_tree_lines(examples, 60)
    prompt_lines = {}
    for n, line in enumerate(plan.lines):
        for e in line:
            if examples[e].prompt_ids[:10] == system:
                prompt_lines.setdefault(examples[e].prompt_ids, set()).add(n)
    assert len(prompt_lines) == 3 and all(len(lines) == 1 for lines in prompt_lines.values())
    assert len({n for lines in prompt_lines.values() for n in lines}) >= 2
    assert plan.splits >= 1 and plan.repeated_tokens >= 10 * plan.splits


def test_a_prefix_every_record_shares_is_counted_once_per_line_and_is_no_split():
    """16 records of 8 prompts behind one 12-token system prompt: lines are filled best fit with the system prompt
    counted once per line (every line holds it), so they hold more records than packed rows, and nothing is a
    split."""
    from prefixdpo.data.packing import plan_packs

    g = random.Random(3)
    examples = _system_prompted(g, _ids(g, 12), 8)
    plan = plan_tree_lines(examples, 128)
    assert max(len(tree_line([examples[e] for e in line])) for line in plan.lines) <= 128
    assert plan.splits == plan.repeated_tokens == 0
    assert len(plan.lines) < len(plan_packs([ex.shared_length for ex in examples], 128))
    for line in plan.lines:  # a prompt's two records in one line
        prompts = [examples[e].prompt_ids for e in line]
        assert all(prompts.count(p) == 2 for p in prompts)


def test_tree_lines_are_the_same_every_epoch_and_in_file_order_when_sequential():
    g = random.Random(2)
    examples = _system_prompted(g, _ids(g, 8), 3) + dialogue(g, 3)
    settings = LoaderSettings(batch_size=1, packing=True, pack_length=48, prefix_tree=True, seed=3)
    micro = MicroBatches(examples, settings)
    lines = {m: [tuple(line) for mb in micro.plan[0] for line in mb] for m in range(3) if not micro.set_epoch(m)}
    assert all(sorted(lines[m]) == sorted(lines[0]) for m in lines) and lines[1] != lines[0]  # reshuffled order
    sequential = MicroBatches(examples, LoaderSettings(batch_size=1, packing=True, pack_length=48, prefix_tree=True,
                                                       sequential=True))
    visited = [e for mb in sequential.plan[0] for line in mb for e in line]
    assert visited == list(range(len(examples)))


@pytest.mark.parametrize("backend,dtype", [("sdpa", torch.float32), ("segmented", torch.float32),
                                           ("segmented", torch.float64)])
def test_tree_lines_of_the_loader_give_every_pair_its_own_loss(backend, dtype):
    """The loader's tree micro-batches (shuffled line order, two lines each, padded) vs each example's own
    prefix-shared row: every pair's combined loss (sigmoid + ipo, a reference that is not the policy) and log-prob
    sums, K_FORWARD eps (fp32: 1e-6) of the log-prob scale; float64 (`tolerances.in_dtype`) on the segment plan."""
    g = random.Random(1)
    examples = dialogue(g, 3) + _system_prompted(g, _ids(g, 8), 2) + dialogue(g, 3)
    examples = [Example(ex.prompt_ids, ex.response_ids, ex.pairs, i) for i, ex in enumerate(examples)]
    policy, ref = in_dtype(tiny_model("llama"), dtype), in_dtype(tiny_model("llama"), dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9)
    for model in (policy, ref):
        prepare_model(model, backend)  # prefixdpo's attention, running the backend's mask
    reference = SeparateModelReference(ref, backend=backend)
    objective = Objective(("sigmoid", "ipo"), (1.0, 0.5), LossParams(beta=0.5))
    micro = MicroBatches(examples, LoaderSettings(batch_size=2, packing=True, pack_length=64, prefix_tree=True))

    tree, trie_tokens = {}, 0
    for m in range(len(micro)):
        item = micro[m]
        assert item.batch.input_ids.shape[1] == 64
        trie_tokens += item.shared_tokens
        step = pair_losses(policy, item.batch, plan_pass(item.batch, backend), reference=reference,
                           objective=objective)
        for e, loss, c, r in zip(item.example_ids.tolist(), step.losses.tolist(),
                                 step.pairs.policy_chosen_logps.tolist(), step.pairs.policy_rejected_logps.tolist()):
            tree[e] = (loss, c, r)
    assert sorted(tree) == list(range(len(examples)))
    assert trie_tokens < 0.8 * sum(ex.shared_length for ex in examples)  # the tries really share across records
    alone = {}
    for e, ex in enumerate(examples):
        batch = build_batch([ex])
        step = pair_losses(policy, batch, plan_pass(batch, backend), reference=reference,
                           objective=objective)
        alone[e] = (step.losses.item(), step.pairs.policy_chosen_logps.item(), step.pairs.policy_rejected_logps.item())
    scale = max(1.0, *(abs(v) for values in alone.values() for v in values[1:]))
    assert_within([alone[e] for e in alone], [tree[e] for e in alone], scale, dtype, k=K_FORWARD,
                  what="losses and sums")
    assert max(v[0] for v in alone.values()) - min(v[0] for v in alone.values()) > 0.1


def _dialogue_file(tmp_path, dialogues: int = 3, turns: int = 3, seed: int = 0) -> tuple[str, int]:
    """A conversational JSONL file: `dialogues` dialogues behind one system prompt, a pair at each of `turns`
    turns; turn t's prompt is the system prompt, the earlier turns (user message, chosen reply) and its own user
    message. Records of the dialogues interleaved, as a file of turns may list them."""
    g = random.Random(seed)
    words = "the cat dog sat ran on a mat hat big small red blue why how it is was not".split()
    say = lambda n: " ".join(g.choice(words) for _ in range(n))  # noqa: E731
    system = {"role": "system", "content": "You are a helpful assistant. " + say(12)}
    records = []
    for _ in range(dialogues):
        history = [system]
        for _ in range(turns):
            history = history + [{"role": "user", "content": say(g.randrange(4, 9))}]
            chosen, rejected = say(g.randrange(2, 7)), say(g.randrange(2, 7))
            records.append({"prompt": history, "chosen": [{"role": "assistant", "content": chosen}],
                            "rejected": [{"role": "assistant", "content": rejected}]})
            history = history + [{"role": "assistant", "content": chosen}]
    g.shuffle(records)
    path = tmp_path / "dialogues.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path), len(records)


def _one_step_equals_standard_dpo(tmp_path, path: str, n_records: int, dtype: torch.dtype = torch.float32,
                                  **tree_options):
    """One SGD step with tries (every line in one micro-batch) vs standard DPO (two rows per record) on `path`,
    a reference that is not the policy, in `dtype` (`tolerances.in_dtype`); then the tree run's trained weights
    evaluate the examples on tree lines and on standard rows. Returns (tree trainer, tree log)."""
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    start = _flat(in_dtype(tiny_model("llama", vocab_size=len(tokenizer)), dtype))
    tree, t_log = one_dpo_step(tmp_path, path, tokenizer, "tree", dtype, prefix_tree=True, packing=True,
                               per_device_train_batch_size=n_records, **tree_options)
    standard, s_log = one_dpo_step(tmp_path, path, tokenizer, "standard", dtype, prefix_sharing=False,
                                   per_device_train_batch_size=n_records)
    assert len(tree._train_micro) == 1
    beta = tree.args.beta
    assert_same_dpo_step((t_log, _flat(tree.model)), (s_log, _flat(standard.model)), start, beta, dtype)
    # Both layouts evaluate the same weights: the two runs' weights differ by lr x their gradients' rounding, whose
    # effect on a loss evaluated after the step nothing here bounds (the step's equality is the gradients' check).
    t_eval = tree.evaluate(eval_dataset=list(tree.train_dataset))
    standard.model.load_state_dict(tree.model.state_dict())
    s_eval = standard.evaluate(eval_dataset=list(standard.train_dataset))
    assert_within(t_eval["eval_loss"], s_eval["eval_loss"], dpo_loss_scale(s_eval, beta, "eval_"), dtype,
                  k=K_FORWARD, what="eval_loss")
    assert t_eval["eval_loss"] != pytest.approx(t_log["loss"], rel=1e-3)
    return tree, t_log


@pytest.mark.parametrize("precompute,dtype", [(False, torch.float32), (True, torch.float32),
                                              (False, torch.float64)])
def test_one_step_on_a_three_turn_dialogue_file_equals_standard_dpo(tmp_path, precompute, dtype):
    """precompute: the tree run's reference sums come from a precomputed table (gathered in tree-line order; the
    table is float32, so no float64 case)."""
    path, n_records = _dialogue_file(tmp_path)
    cache = {"precompute_ref_log_probs": True, "ref_cache_dir": str(tmp_path / "c")} if precompute else {}
    tree, log = _one_step_equals_standard_dpo(tmp_path, path, n_records, dtype, pack_length=1024, **cache)
    micro = tree._train_micro[0]
    per_record = sum(tree.train_dataset[e].shared_length for e in micro.example_ids.tolist())
    # the system prompt once per line and each dialogue's earlier turns once: far below per-record sharing
    assert micro.shared_tokens < 0.5 * per_record
    assert log["prefix_sharing/tokens_saved"] > 0.7


@pytest.mark.parametrize("group_by_prompt", [False, True])
def test_one_step_on_an_shp_like_file_with_tries_equals_standard_dpo(tmp_path, group_by_prompt):
    path, n_records = _shp_file(tmp_path)
    tree, log = _one_step_equals_standard_dpo(tmp_path, path, n_records, group_by_prompt=group_by_prompt)
    micro = tree._train_micro[0]
    per_record = sum(tree.train_dataset[e].shared_length for e in micro.example_ids.tolist())
    assert micro.shared_tokens < (per_record if group_by_prompt else 0.6 * per_record)


def test_tree_token_weights_count_the_sequences_through_each_node():
    """The line [1 2 3 5 6 7 8 4 5 7] of the sequences [1 2 3 5 6], [1 2 3 7], [1 2 3 8] (pairs (0, 1), (0, 2))
    and [1 2 4 5], [1 2 4 7] (pair (1, 0)): a node weighs the pairs of every response whose sequence passes through
    it (TRL's rows holding it); padding 0."""
    examples = [Example((1, 2, 3), ((5, 6), (7,), (8,)), ((0, 1), (0, 2))), Example((1, 2, 4), ((5,), (7,)), ((1, 0),))]
    batch = build_tree_batch(examples, pad_multiple=4)
    # rows: 1 2 3 5 6 7 8 4 5 7 (padding 2); responses in pairs: 2, 1, 1 (record 0), 1, 1 (record 1)
    assert batch.input_ids[0, :10].tolist() == [1, 2, 3, 5, 6, 7, 8, 4, 5, 7]
    assert trl_token_multiplicity(batch)[0].tolist() == [6, 6, 4, 2, 2, 1, 1, 2, 1, 1, 0, 0]


def _aux_loss_of_trl(model, examples) -> torch.Tensor:
    """TRL 1.16's own load-balancing loss on its padded `[prompt][response]` rows (its fused-head forward)."""
    from trl.trainer.utils import add_fused_lm_head

    trl_model = copy.deepcopy(model)
    add_fused_lm_head(trl_model, outputs=("log_probs",))
    ids, mask = trl_rows(examples, pad=0)
    with torch.no_grad():
        return trl_model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                         fused_lm_head=True, output_router_logits=True).aux_loss


def _moe_records(seed: int) -> list[Example]:
    """Records of prompts named three times (a response in two records), records behind a system prompt and a
    3-turn dialogue; numbered."""
    g = random.Random(seed)
    records = depth_1(g) + depth_2(g) + dialogue(g, 3)
    return [Example(ex.prompt_ids, ex.response_ids, ex.pairs, i) for i, ex in enumerate(records)]


@pytest.mark.parametrize("arch", sorted(MOE))
def test_router_aux_loss_on_tree_lines_equals_trl_on_its_padded_rows(arch):
    """One tree line and three (padded), dense mask and segment plan: TRL's value within 1e-5 relative; the same
    router logits weighted once per node (what the tree computes) are not TRL's value."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    pytest.importorskip("trl")
    model = tiny_model(arch, **MOE[arch])
    examples = _moe_records(5)
    trl_aux = _aux_loss_of_trl(model, examples)
    n = len(examples)
    for backend in ("sdpa", "segmented"):
        prepare_model(model, backend)
        for lines in (None, [list(range(0, 6)), list(range(6, 10)), list(range(10, n))]):
            batch = build_tree_batch(examples, lines, pad_multiple=8)
            with torch.no_grad():
                ours = compute_response_logps(model, batch, plan_pass(batch, backend), router_aux=True)
            # the aux loss is E x sum over experts of (routed fraction x mean probability), inputs O(1 / E): its
            # own magnitude is its inputs' scale
            assert_within(ours.aux_loss, trl_aux, trl_aux.abs().item(), k=K_FORWARD, what=f"aux {backend} {lines}")
    prepare_model(model, "sdpa")
    batch = build_tree_batch(examples)
    with torch.no_grad(), recording_router_logits(model) as recorded:
        compute_response_logps(model, batch, plan_pass(batch, "sdpa"))
    once = load_balancing_loss_func(tuple(recorded), 4, 2, (batch.spans[..., 0] >= 0).float())
    assert (once - trl_aux).abs() > 1e-4 * trl_aux.abs(), (once.item(), trl_aux.item())


def test_one_dpo_step_with_the_moe_aux_loss_on_tries_equals_one_without(tmp_path):
    """router_aux_loss_coef 0.5 (large, so a mis-weighted aux term shows) on a tiny Mixtral: one SGD step on tree
    lines (several, one micro-batch) equals one on per-record prefix-shared rows, with a reference that is not the
    policy; and the aux term is in the loss."""
    pytest.importorskip("trl")
    examples = _moe_records(6)
    n = len(examples)

    def one_step(name, **options):
        ref = tiny_model("mixtral", **MOE["mixtral"])
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(0.9)
        trainer = PrefixDPOTrainer(model=tiny_model("mixtral", **MOE["mixtral"]), ref_model=ref, train_dataset=examples,
                                   args=_dpo_config(tmp_path, name, per_device_train_batch_size=n, **options))
        trainer.train()
        (log,) = [h for h in trainer.state.log_history if "loss" in h]
        return trainer, log

    tree, t_log = one_step("tree", router_aux_loss_coef=0.5, prefix_tree=True, packing=True, pack_length=64)
    rows, r_log = one_step("rows", router_aux_loss_coef=0.5)
    (micro,) = tree._train_micro
    assert micro.batch.input_ids.shape[0] >= 2
    assert micro.shared_tokens < sum(ex.shared_length for ex in tree.train_dataset)  # tries across records
    start = _flat(tiny_model("mixtral", **MOE["mixtral"]))
    # the logged loss holds coef x the aux loss, a mean of O(1) router fractions x probabilities: within the scale
    assert_same_dpo_step((t_log, _flat(tree.model)), (r_log, _flat(rows.model)), start, tree.args.beta)
    _, plain = one_step("plain", router_aux_loss_coef=0.0, prefix_tree=True, packing=True, pack_length=64)
    assert abs(plain["loss"] - t_log["loss"]) > 1e-3  # the aux term is in the loss


def test_prefix_tree_needs_prefix_sharing_and_packing(tmp_path):
    from prefixdpo.commands.train import parse_train_args

    assert PrefixDPOConfig(output_dir=str(tmp_path)).prefix_tree is False
    config, *_ = parse_train_args(["--output_dir", str(tmp_path), "--prefix_tree", "true", "--packing", "true"])
    assert config.prefix_tree is True
    with pytest.raises(ConfigError, match="prefix_tree=true needs prefix_sharing=true and packing=true"):
        PrefixDPOConfig(output_dir=str(tmp_path), prefix_tree=True)
    with pytest.raises(ConfigError, match="prefix_tree=true needs"):
        PrefixDPOConfig(output_dir=str(tmp_path), prefix_tree=True, packing=True, prefix_sharing=False)
    with pytest.raises(ConfigError, match="prefix_tree=true needs"):
        PrefixRewardConfig(output_dir=str(tmp_path), prefix_tree=True, use_cpu=True)


def k_response_records(seed: int = 0, prompts: int = 4) -> list[Example]:
    """Multi-response records behind one 10-token system prompt: each prompt named by two records of K = 3 and
    K = 4 responses (one response in both records), several pairs each, one pair against the order the responses
    came in; a prompt, the system prompt's subtree and the responses of one prompt are three depths of one trie."""
    g = random.Random(seed)
    system = _ids(g, 10)
    out = []
    for _ in range(prompts):
        prompt = system + _ids(g, g.randrange(3, 7))
        responses = [_ids(g, g.randrange(2, 6)) for _ in range(6)]
        out.append(Example(prompt, responses[:3], ((0, 1), (0, 2), (2, 1))))
        out.append(Example(prompt, (responses[0], *responses[3:]), ((1, 0), (0, 2), (3, 1), (2, 3))))
    return [Example(ex.prompt_ids, ex.response_ids, ex.pairs, i) for i, ex in enumerate(out)]


def _trainable(model) -> torch.Tensor:
    """Every trainable parameter, flattened in order (the LoRA adapters with `peft_config`)."""
    return torch.cat([p.detach().flatten().clone() for p in model.parameters() if p.requires_grad])


def _one_step_on(tmp_path, name: str, examples, *, peft_config=None, **options):
    """(trainer, its logged step, trainable weights before [N], after [N]) of one SGD step (lr 10, every example in
    one micro-batch) from the tiny Llama every run starts from; the reference is the model with its weights x 0.9,
    or, with `peft_config` (LoRA adapters initialised non-zero), the policy with its adapter off."""
    ref = None
    if peft_config is None:
        ref = tiny_model("llama")
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(0.9)
    trainer = PrefixDPOTrainer(model=tiny_model("llama"), ref_model=ref, peft_config=peft_config,
                               args=_dpo_config(tmp_path, name, per_device_train_batch_size=len(examples), **options),
                               train_dataset=examples)
    before = _trainable(trainer.model)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert len(trainer._train_micro) == 1
    return trainer, log, before, _trainable(trainer.model)


def _same_step(a: tuple, b: tuple) -> float:
    """Asserts two `_one_step_on` results (from the same start) took the same step (`assert_same_dpo_step`);
    returns the gradients' difference in eps x their scale."""
    (trainer, a_log, start, a_w), (_, b_log, _, b_w) = a, b
    return assert_same_dpo_step((a_log, a_w), (b_log, b_w), start, trainer.args.beta)


def test_one_lora_step_on_tree_lines_equals_the_packed_prefix_shared_step(tmp_path):
    """LoRA (q/v adapters, initialised non-zero; the reference is the adapter off): one step on tree lines equals
    the same step on packed prefix-shared rows (no trie), loss and every adapter gradient 1e-5; the base weights
    stay as they were."""
    from peft import LoraConfig

    lora = lambda: LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,  # noqa: E731
                              init_lora_weights=False)
    examples = k_response_records() + dialogue(random.Random(5), 3)
    tree = _one_step_on(tmp_path, "tree", examples, peft_config=lora(), packing=True, pack_length=512,
                        prefix_tree=True)
    packed = _one_step_on(tmp_path, "packed", examples, peft_config=lora(), packing=True, pack_length=512)
    assert tree[0].reference.adapter_off
    assert tree[1]["prefix_sharing/tokens_saved"] > packed[1]["prefix_sharing/tokens_saved"]  # the trie shared more
    _same_step(tree, packed)
    base = {n: p for n, p in tree[0].model.named_parameters() if not p.requires_grad}
    start = dict(tiny_model("llama").named_parameters())
    assert all(torch.equal(p, start[n.replace("base_model.model.", "").replace(".base_layer", "")])
               for n, p in base.items())


def test_one_step_on_k_response_records_on_tree_lines_equals_standard_dpo(tmp_path):
    """Records of K = 3 and 4 responses and several pairs each (two per prompt, all behind one system prompt) on
    tree lines, packed two lines to the micro-batch, vs standard DPO (every `[prompt][response]` its own row): one
    step, loss and gradients 1e-5."""
    examples = k_response_records()
    tree = _one_step_on(tmp_path, "tree", examples, packing=True, pack_length=96, prefix_tree=True)
    standard = _one_step_on(tmp_path, "standard", examples, prefix_sharing=False)
    micro = tree[0]._train_micro[0]
    assert micro.batch.input_ids.shape[0] >= 2  # several lines in the micro-batch
    assert micro.batch.num_pairs == sum(len(ex.pairs) for ex in examples)
    assert micro.shared_tokens < sum(ex.shared_length for ex in examples)  # the trie shares across records
    _same_step(tree, standard)
