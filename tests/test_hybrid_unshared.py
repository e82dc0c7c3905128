"""Every model TRL's trainers train, prefixdpo trains with `--prefix_sharing false`, numerically as TRL (issue 37).

The tiny hybrid families (`prefixdpo_tools.hybrid_models`: Gated DeltaNet, Kimi Delta Attention, short convolutions,
Mamba2 beside attention, and gpt-oss's attention sinks) carry state along the sequence or attend in ways prefixdpo's
attention does not reproduce on shared lines. With prefix sharing off they run their own attention implementation
on TRL's right-padded rows with a 2D padding mask (`core.stock_attention`, pass backend STOCK). Shown here:
- `prefixdpo train --prefix_sharing false` runs every family (one step); reward, grpo and rloo run some;
- one DPOTrainer step of TRL 1.16 on Qwen3.5, LFM2, NemotronH (a Mamba2 hybrid) and gpt-oss equals ours: logged loss,
  rewards and log-probs (`tolerances.assert_same_dpo_log` at K, as `test_trl_parity.compare`), grad norm, and every
  gradient, read off an SGD step (`tolerances.sgd_grad_scale`); the worst of each printed as a REPORT line (-s);
- RewardTrainer on gpt-oss (eager attention with sinks and a sliding window) equals ours step for step;
- 4 GRPOTrainer steps on Qwen3.5 equal ours (same completions, metrics, final weights);
- with prefix sharing on, one line naming the layer types and `--prefix_sharing false`, exit 2; packing refused.
Each tiny model is built once per module (`_hybrid`), fp32 on CPU.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

from prefixdpo.cli import main
from prefixdpo.core.model_checks import unshareable_layers
from prefixdpo_tools.hybrid_models import HYBRID_FAMILIES, tiny_hybrid_lm
from test_trl_parity import parity_records, shared_options, step_logs
from tolerances import K, assert_same_dpo_log, assert_within, sgd_grad_scale

pytest.importorskip("trl")


@functools.cache
def tokenizer():
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


@functools.cache
def _hybrid(family: str, std: float = 0.2):
    """The tiny model of `family` (weight matrices at `std`) over the tiny tokenizer's vocabulary (its embeddings and
    head grown from the builder's 96 ids, seeded), with the tokenizer's special tokens."""
    tok = tokenizer()
    model = tiny_hybrid_lm(family, std=std)
    torch.manual_seed(1)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    special = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model.config.update(special)
    model.generation_config.update(**special)
    return model


def hybrid(family: str):
    """A fresh copy of `_hybrid(family)`."""
    return copy.deepcopy(_hybrid(family))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """save(family) -> the folder of that family's model and tokenizer (saved once); folder.parent holds
    pairs.jsonl (4 preference records) and prompts.jsonl (4 prompts)."""
    root = tmp_path_factory.mktemp("hybrids")
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in parity_records(4)))
    prompt = {"prompt": "Question: what is the capital of France? Answer:"}
    (root / "prompts.jsonl").write_text((json.dumps(prompt) + "\n") * 4)

    @functools.cache
    def save(family: str):
        folder = root / family
        _hybrid(family).save_pretrained(folder)
        tokenizer().save_pretrained(folder)
        return folder

    return save


RUN = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--use_cpu", "--bf16", "false",
       "--gradient_checkpointing", "false", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]
GROUP = ["--reward_funcs", "prefixdpo_tools.demo_grpo:vowel_share", "--num_generations", "2",
         "--max_completion_length", "6"]


def run_cli(command: str, folder, out, *extra: str) -> int:
    data = folder.parent / ("pairs.jsonl" if command in ("train", "reward") else "prompts.jsonl")
    return main([command, "--model", str(folder), "--dataset", str(data), "--output_dir", str(out), *RUN,
                 *(GROUP if command in ("grpo", "rloo") else ()), *extra])


def error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(lines) == 1, lines
    return lines[0]


# ---- which layers prefix sharing cannot run yet ------------------------------------------------------------------

UNSHAREABLE = {"jamba": ["JambaMambaMixer"]}  # every other family's recurrent layers run on shared lines (core.recurrent)


def test_unshareable_layers_names_every_state_carrying_layer_type():
    from conftest import tiny_model

    assert {family: unshareable_layers(_hybrid(family)) for family in HYBRID_FAMILIES} == {
        family: UNSHAREABLE.get(family, []) for family in HYBRID_FAMILIES}
    assert unshareable_layers(tiny_model("llama")) == []
    # a config that names no layer types: a supported mixer's convolution is no unshareable layer
    lfm2 = hybrid("lfm2")
    lfm2.config.layer_types = None
    assert unshareable_layers(lfm2) == []


# ---- the command line --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_train_runs_every_family_with_prefix_sharing_off(family, saved, tmp_path, caplog):
    import logging

    from transformers import AutoModelForCausalLM

    caplog.set_level(logging.INFO, logger="prefixdpo.training.model_setup")
    assert run_cli("train", saved(family), tmp_path / "out", "--prefix_sharing", "false") == 0
    name = type(_hybrid(family)).__name__
    # only the family prefixdpo's attention cannot run takes its own; the others run prefixdpo's attention (gpt-oss's
    # sinks through its own eager attention) and recurrent runs on unshared rows
    own = {"jamba": "sdpa"}.get(family)
    stock_line = f"prefix sharing off: {name} runs its own attention ({own}) on padded rows"
    assert (stock_line in caplog.text) == (own is not None)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # a stock model, loadable anywhere
    # gpt-oss has no SDPA: its export names eager, as TRL runs it; a pure Mamba2 has no attention (transformers says
    # eager for it)
    stock = "eager" if family in ("gpt_oss", "mamba2") else "sdpa"
    assert type(exported).__name__ == name and exported.config._attn_implementation == stock


@pytest.mark.parametrize("family", [f for f in HYBRID_FAMILIES if f not in UNSHAREABLE])
def test_train_runs_every_recurrent_family_with_prefix_sharing_on(family, saved, tmp_path):
    assert run_cli("train", saved(family), tmp_path / "out", "--packing", "true") == 0


@pytest.mark.parametrize("options", [("--precompute_ref_log_probs", "true"),
                                     ("--prefix_tree", "true", "--packing", "true"),
                                     ("--prefix_reuse", "true", "--max_tokens_per_pass", "24"),
                                     ("--loss_type", "ipo", "--group_by_prompt", "true")])
def test_reference_strategies_tries_and_prefix_reuse_run_on_a_hybrid_with_prefix_sharing_on(options, saved, tmp_path):
    assert run_cli("train", saved("qwen3_5_text"), tmp_path / "out", *options) == 0


def test_precomputed_reference_runs_unshared_rows(saved, tmp_path):
    # the reference table's batches are laid out as the run's (one padded row per response), not shared
    assert run_cli("train", saved("lfm2"), tmp_path / "out", "--prefix_sharing", "false",
                   "--precompute_ref_log_probs", "true") == 0


@pytest.mark.parametrize("command,family", [("reward", "gpt_oss"), ("reward", "qwen3_5_text"), ("grpo", "lfm2"),
                                            ("grpo", "nemotron_h"), ("grpo", "kimi_linear"), ("rloo", "gpt_oss")])
def test_reward_grpo_and_rloo_run_with_prefix_sharing_off(command, family, saved, tmp_path):
    assert run_cli(command, saved(family), tmp_path / "out", "--prefix_sharing", "false") == 0


@pytest.mark.parametrize("command,family", [("reward", "qwen3_5_text"), ("reward", "gpt_oss"), ("grpo", "lfm2"),
                                            ("rloo", "nemotron_h"), ("grpo", "gpt_oss")])
def test_reward_grpo_and_rloo_run_with_prefix_sharing_on(command, family, saved, tmp_path):
    """The shared passes (recurrent runs from their prompt's states, sinks and windows on the dense mask) and, for
    grpo/rloo, the shared prefill of generation, through the command line."""
    assert run_cli(command, saved(family), tmp_path / "out") == 0


def test_a_family_without_a_classifier_is_refused_as_a_reward_model_in_one_line(saved, tmp_path, capsys):
    folder = saved("lfm2")
    assert run_cli("reward", folder, tmp_path / "out", "--prefix_sharing", "false") == 2
    assert error_line(capsys) == (
        f"prefixdpo reward: error: {folder}: transformers has no sequence-classification model for Lfm2Config "
        "(AutoModelForSequenceClassification, which TRL's RewardTrainer loads too); a reward model needs one")


def test_trls_moe_loss_crash_on_granite_is_one_line_and_coef_0_runs(saved, tmp_path, capsys):
    folder = saved("granitemoehybrid")
    assert run_cli("grpo", folder, tmp_path / "a", "--prefix_sharing", "false") == 2
    assert error_line(capsys) == (
        "prefixdpo grpo: error: router_aux_loss_coef=0.001: TRL 1.16's GRPO/RLOO passes read num_experts from the "
        "model config, which GraniteMoeHybridConfig does not have; set --router_aux_loss_coef 0")
    assert run_cli("grpo", folder, tmp_path / "b", "--prefix_sharing", "false", "--router_aux_loss_coef", "0") == 0


@pytest.mark.parametrize("command", ["train", "grpo"])
def test_prefix_sharing_on_refuses_a_recurrent_model_in_one_line(command, saved, tmp_path, capsys):
    assert run_cli(command, saved("jamba"), tmp_path / "out") == 2
    assert error_line(capsys) == (
        f"prefixdpo {command}: error: JambaForCausalLM has layers of type ['JambaMambaMixer'], which carry a "
        "convolution or recurrent state along the sequence: prefixdpo cannot reproduce them on prefix-shared lines "
        "(JambaMambaMixer runs its Mamba 1 selective scan from the zero state only, taking no initial state: a "
        "response could start from its prompt's final state only token by token); train it without prefix sharing "
        "(--prefix_sharing false: TRL's padded rows on the model's own attention)")
    assert not (tmp_path / "out" / "config.json").exists()


def test_attention_sinks_train_on_the_segmented_backend(saved, tmp_path):
    """gpt-oss's sinks on the segmented backend (its own eager attention per group of segments), through the command
    line, packed (varlen, CUDA only, refuses them: tests/test_attention_sinks.py)."""
    assert run_cli("train", saved("gpt_oss"), tmp_path / "out", "--attention", "segmented", "--packing", "true") == 0


def test_a_reference_that_cannot_run_the_policys_attention_is_refused_in_one_line(saved, tmp_path, capsys):
    """A Llama policy runs prefixdpo's attention with prefix sharing off; a Jamba reference cannot run its passes
    (the other way round, a hybrid policy's reference runs its own attention too: it trains)."""
    from conftest import tiny_model

    llama = tmp_path / "llama"
    tiny_model("llama", vocab_size=len(tokenizer()), pad_token_id=tokenizer().pad_token_id).save_pretrained(llama)
    tokenizer().save_pretrained(llama)
    (tmp_path / "pairs.jsonl").write_text((saved("jamba").parent / "pairs.jsonl").read_text())
    off = ("--prefix_sharing", "false")
    assert run_cli("train", llama, tmp_path / "a", *off, "--ref_model_name_or_path", str(saved("jamba"))) == 2
    assert error_line(capsys) == (
        "prefixdpo train: error: ref_model JambaForCausalLM cannot run the policy's passes, which run prefixdpo's "
        "attention (attention=sdpa): its layers of type ['JambaMambaMixer']; use a reference of the policy's "
        "architecture, or none (a frozen copy of the policy)")
    assert run_cli("train", saved("jamba"), tmp_path / "b", *off, "--ref_model_name_or_path", str(llama)) == 0


def test_attention_without_position_ids_is_refused_shared_and_trains_unshared(saved, tmp_path, capsys):
    """Bloom's forward takes no position_ids (ALiBi from its mask): with prefix sharing on, one line naming them and
    the way out; with it off, it trains as TRL runs it (handed no position_ids, `model_call.model_pass`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tokenizer()
    config = AutoConfig.for_model("bloom", vocab_size=len(tok), hidden_size=32, n_layer=2, n_head=2,
                                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id)
    bloom = tmp_path / "bloom"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(bloom)
    tok.save_pretrained(bloom)
    (tmp_path / "pairs.jsonl").write_text((saved("jamba").parent / "pairs.jsonl").read_text())
    assert run_cli("train", bloom, tmp_path / "on") == 2
    assert error_line(capsys) == (
        "prefixdpo train: error: BloomForCausalLM.forward takes no position_ids, so a response cannot restart its "
        "positions after its prompt on a shared line; train it with --prefix_sharing false")
    assert run_cli("train", bloom, tmp_path / "off", "--prefix_sharing", "false") == 0
    assert (tmp_path / "off" / "model.safetensors").exists()


def test_packing_is_refused_for_a_model_on_its_own_attention(saved, tmp_path, capsys):
    assert run_cli("train", saved("jamba"), tmp_path / "out", "--prefix_sharing", "false", "--packing", "true") == 2
    assert error_line(capsys) == (
        "prefixdpo train: error: packing=true cannot run JambaForCausalLM with prefix sharing off: its own attention "
        "and layers would run one packed sequence into the next (prefixdpo's attention, which keeps them apart, "
        "cannot run it); set --packing false")


# ---- equal to TRL 1.16's trainers --------------------------------------------------------------------------------

DPO_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
LR = 0.5  # SGD: each weight moves by lr x its gradient, so the step's gradients are read off the weights


def dpo_step(trainer_cls, config_cls, model, records, options: dict):
    """One SGD step of a DPO trainer on `records` (4, one batch); (its log, start weights, trained weights)."""
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    args = config_cls(**options)
    trainer = trainer_cls(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=records,
                          processing_class=tokenizer())
    trainer.train()
    trained = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return step_logs(trainer), start, trained


def trl_and_ours(family: str, tmp_path, steps: int, **ours_options):
    """`steps` SGD steps of TRL 1.16's DPOTrainer and of ours (with `ours_options`) on 4 x `steps` parity records
    from the same tiny `family` model: (theirs, ours), each `dpo_step`'s (logs, start weights, trained weights)."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from prefixdpo import PrefixDPOConfig, PrefixDPOTrainer

    datasets.disable_progress_bars()
    records = parity_records(4 * steps)
    options = {**shared_options(tmp_path, "run", 4, 1), "max_steps": steps, "optim": "sgd", "learning_rate": LR}
    trl_options = dict(padding_free=False, pad_to_multiple_of=None, use_weighting=False, ld_alpha=None,
                       f_divergence_type="reverse_kl", sync_ref_model=False)
    theirs = dpo_step(DPOTrainer, lambda **o: DPOConfig(**trl_options, **o), hybrid(family),
                      datasets.Dataset.from_list(records), {**options, "output_dir": str(tmp_path / "trl")})
    ours = dpo_step(PrefixDPOTrainer, lambda **o: PrefixDPOConfig(**ours_options, **o), hybrid(family), records,
                    {**options, "output_dir": str(tmp_path / "ours")})
    return theirs, ours


# gpt-oss: eager attention with sinks, and a MoE load-balancing loss (coefficient 0.001) in the step's loss
@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2", "nemotron_h", "gpt_oss", "mamba2"])
def test_one_dpo_step_equals_trl_dpo_trainer(family, tmp_path):
    theirs, ours = trl_and_ours(family, tmp_path, steps=1, prefix_sharing=False)
    assert len(theirs[0]) == len(ours[0]) == 1
    (t,), (o,) = theirs[0], ours[0]
    logged = assert_same_dpo_log(t, o, 0.1, DPO_KEYS, k=K, what=family)  # TRL's DPO step tolerances, as
    # `test_trl_parity.compare`: K eps x the loss scale / the log-probs' size
    logged = max(logged, assert_within(o["grad_norm"], t["grad_norm"], t["grad_norm"], what=f"{family} grad_norm"))
    start = theirs[1]
    grads = [(start - trained) / LR for trained in (theirs[2], ours[2])]
    assert grads[0].abs().max() > 1e-3  # the step moved the weights
    worst = assert_within(grads[1], grads[0], sgd_grad_scale(grads[0], start, LR), what=f"{family} gradients")
    print(f"REPORT dpo {family}: logged values {logged:.2f}, gradients {worst:.2f} eps x their scale")


# mamba2: a pure state-space model, whose forward takes no position_ids (handed none, as TRL hands none)
@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "gpt_oss", "mamba2"])
def test_three_dpo_steps_with_prefix_sharing_equal_trl_dpo_trainer(family, tmp_path):
    """Prefix sharing ON (each record one shared line; unpacked, as test_trl_parity: best-fit packing reorders the
    records into other steps): the recurrent layers run each response from its prompt's final state
    (core.recurrent); 3 sequential SGD steps equal TRL 1.16's DPOTrainer on padded rows, step for step (logged values)
    and in the final weights."""
    from tolerances import weights_scale

    theirs, ours = trl_and_ours(family, tmp_path, steps=3, prefix_sharing=True, packing=False)
    assert len(theirs[0]) == len(ours[0]) == 3
    logged = max(assert_same_dpo_log(t, o, 0.1, DPO_KEYS, k=K, what=f"{family} step {i}")
                 for i, (t, o) in enumerate(zip(theirs[0], ours[0]), 1))
    start, trained_t, trained_o = theirs[1], theirs[2], ours[2]
    assert (trained_t - start).abs().max() > 1e-3  # the steps moved the weights
    weights = assert_within(trained_o, trained_t, weights_scale(start, trained_t), what=f"{family} final weights")
    print(f"REPORT dpo shared {family}: logged values {logged:.2f}, final weights {weights:.2f} eps x their scale")


def test_reward_steps_equal_trl_reward_trainer_on_gpt_oss(saved, tmp_path):
    """gpt-oss as a reward model: eager attention with sinks and a 16-token sliding window (records to 27 tokens)."""
    from test_reward_trainer import assert_same_reward_log
    from test_reward_trl_parity import options, run_trl

    from prefixdpo import PrefixRewardConfig, PrefixRewardTrainer
    from prefixdpo.reward.model import load_reward_model

    model = load_reward_model(saved("gpt_oss"), seed=0)
    records = [{**r, "margin": 0.25 * (i % 3)} for i, r in enumerate(parity_records(8))]
    theirs = run_trl(records, tokenizer(), model, options(tmp_path, "trl"))
    args = PrefixRewardConfig(prefix_sharing=False, **options(tmp_path, "ours"))
    trainer = PrefixRewardTrainer(model=copy.deepcopy(model), args=args, processing_class=tokenizer(),
                                  train_dataset=records)
    trainer.train()
    ours = [h for h in trainer.state.log_history if "loss" in h]
    assert len(theirs) == len(ours) == 2
    for step, (t, o) in enumerate(zip(theirs, ours), 1):
        assert_same_reward_log(o, t, model, k=K, what=f"step {step}")  # K: after Adam steps, as its TRL parity test
        assert o["accuracy"] == t["accuracy"]
    print("REPORT reward gpt_oss: " + ", ".join(f"step {step} loss diff {abs(t['loss'] - o['loss']):.2e}"
                                                 for step, (t, o) in enumerate(zip(theirs, ours), 1)))


# Weight matrices at std 0.05 for the GRPO comparison: at the suite's std 0.2 this tiny Qwen3.5 is ill-conditioned under
# SGD steps at lr 0.5: TRL against itself, its initial weights moved by ~1 ulp, logs grad_norms 18.6, 242, 1717 and
# 24516 eps x their scale apart at steps 1-4 (measured), so no run, TRL's own included, reproduces another to rounding
# there (prefix sharing against TRL: 131 at step 2, the same growth). At std 0.05 TRL against itself: 1.1, 6.3, 31.7,
# 51.
GRPO_STD = 0.05


@pytest.mark.parametrize("prefix_sharing", [False, True])
def test_grpo_steps_equal_trl_grpo_trainer_on_qwen3_5(prefix_sharing, tmp_path):
    """4 GRPO steps (SGD, lr 0.5) of TRL 1.16's GRPOTrainer and ours on tiny Qwen3.5: the same rollouts, every logged
    metric within the suite's bound, and the final weights. prefix_sharing False: TRL's own passes; True: each group's
    prompt once, its completions run from the prompt's Gated DeltaNet and convolution states (`core.recurrent`)."""
    from test_grpo_trl_parity import OURS_ONLY, metric_within, run
    from tolerances import weights_scale
    from trl import GRPOConfig, GRPOTrainer

    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer

    options = dict(loss_type="grpo", beta=0.04, num_iterations=1, num_generations=2, per_device_train_batch_size=4)
    folder = tmp_path / "qwen3_5_text"
    _hybrid("qwen3_5_text", std=GRPO_STD).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    folder = str(folder)
    logs_t, rollouts_t, initial, final_t = run(GRPOTrainer, GRPOConfig, folder, tmp_path / "trl", **options)
    logs_o, rollouts_o, _, final_o = run(PrefixGRPOTrainer, PrefixGRPOConfig, folder, tmp_path / "ours",
                                         prefix_sharing=prefix_sharing, **options)
    assert rollouts_t == rollouts_o and len(logs_t) == len(logs_o) == 4
    assert all((step.get("prefix_sharing/tokens_saved", 0) > 0) == prefix_sharing for step in logs_o)  # it shared
    worst = 0.0
    for step_t, step_o in zip(logs_t, logs_o):
        keys = {k for k in step_t if k not in ("step_time", "epoch", "step")}
        assert keys == {k for k in step_o if k not in ("step_time", "epoch", "step") and not k.startswith(OURS_ONLY)}
        for key in keys:
            worst = max(worst, metric_within(key, float(step_t[key]), float(step_o[key]), step_t))
    flat_t, flat_o, flat_0 = (torch.cat([w[n].flatten() for n in initial]) for w in (final_t, final_o, initial))
    assert (flat_t - flat_0).abs().max() > 0.01  # the weights moved
    weights = assert_within(flat_o, flat_t, weights_scale(flat_0, flat_t), what="final weights")
    print(f"REPORT grpo qwen3_5_text sharing={prefix_sharing}: metrics {worst:.2f}, final weights {weights:.2f} eps x "
          "their scale")


def test_auto_attention_picks_sdpa_for_a_model_without_flex():
    """On CUDA `auto` is flex; a model that does not declare FlexAttention (Qwen3.5) gets sdpa instead of a refusal,
    while an explicit flex is still refused in one line and a flex model keeps flex."""
    from prefixdpo.core.model_checks import backend_for_model, refusal

    qwen = _hybrid("qwen3_5_text")
    assert backend_for_model(qwen, "flex", "auto") == "sdpa"
    assert backend_for_model(qwen, "flex", "flex") == "flex" and "use --attention sdpa" in refusal(qwen, "flex")
    assert backend_for_model(_hybrid("lfm2"), "flex", "auto") == "flex"
    assert backend_for_model(qwen, "sdpa", "auto") == "sdpa"
