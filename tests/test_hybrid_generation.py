"""Shared-prompt generation (`grpo/generation.py`, `grpo/cache_rows.py`) on hybrids == transformers' own generate.

Each unique prompt's first P - 1 columns are prefilled once; every recurrent layer's conv and recurrent states are
expanded to its G rows by index (`reorder_cache`) and the last prompt column runs through the mixers' decode path
(one-column conv update, recurrent step) where plain generation runs it inside the chunked prefill. The two agree to
rounding: each step's logits within K_FORWARD x eps x scale, a logit's scale being that of the head's dot product,
whose terms cancel (`tolerances`' rule for a score): the largest |h| . |w| over rows and vocabulary, h the final
hidden state, w the head's rows. Greedy token ids are compared where every step's top-2 margin exceeds twice the
bound (no tie); sampled ones (seeded, TRL's options) with the random state after, in fp32 on Qwen3.5 and NemotronH,
where a token could flip only if a draw fell within ~1e-6 of a boundary between two tokens' probabilities (as
tests/test_grpo_generation.py argues: far too rare to meet), and in float64 on LFM2.

Qwen3.5-MoE and Granite 4 hybrid (`OWN_ROUNDING`, both MoE: their experts' grouped matmuls round by how many tokens
each expert gets, so by the batch's make-up) are compared on token ids in fp32 (margin above twice the measured
difference), their logits in float64 with every float32 cast of their modeling code lifted: in fp32 these tiny random
models move their own logits beyond the rule's O(1) slopes (measured, Qwen3.5-MoE: shared vs plain 43 eps32 x the dot
scale; plain generate of its 3 prompts alone vs among the 9 rows 31 at the first step; two equal rows of one batch 5
apart. Granite 4: shared vs plain 1.8 to 8.7 by CPU capability and test order; plain alone vs among the 9 rows 11 to
22), in float64 without the casts the two agree within the rule.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from prefixdpo.grpo import generation
from prefixdpo.grpo.cache_rows import RECURRENT_LAYERS, unshared_mixers
from prefixdpo.grpo.generation import group_prompt_rows, why_not_shared
from prefixdpo_tools.hybrid_models import HYBRID_FAMILIES, tiny_hybrid_lm
from test_grpo_generation import both_ways  # (plain, shared, rng state after each, route)
from tolerances import EPS32, EPS64, K_FORWARD

# every family whose recurrent states the shared prefill hands on (Zamba2's it refuses: see the why_not_shared test)
RECURRENT_FAMILIES = [f for f in HYBRID_FAMILIES if f not in ("gpt_oss", "zamba2")]
# plain generate's own logits move by more than K_FORWARD eps x scale between batch shapes (module doc)
OWN_ROUNDING = {"qwen3_5_moe_text", "granitemoehybrid"}
PAD, EOS = 0, 2


def prompt_batch(lengths=(9, 4, 6), copies=3, seed=0):
    """Left-padded rows [N, P] of the tiny models' vocabulary: each prompt `copies` times, interleaved."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 96, (n,), generator=g).tolist() for n in lengths]
    rows = [p for _ in range(copies) for p in prompts]
    P = max(lengths)
    ids = torch.tensor([[PAD] * (P - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def greedy_config(new_tokens: int = 8, **overrides) -> GenerationConfig:
    options = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD, eos_token_id=EOS,
                   return_dict_in_generate=True, output_logits=True)
    return GenerationConfig(**{**options, **overrides})


def logit_scale(model, sequences, mask) -> float:
    """The largest |h| . |w| over the decoding steps' rows and the vocabulary: h the final hidden state that gives
    each step's logits (positions P - 1 ..., one forward of the plain sequences [N, L], mask the prompts' [N, P]), w
    the head's rows."""
    P = mask.shape[1]
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, P:])], dim=1)
    with torch.no_grad():
        out = model(input_ids=sequences, attention_mask=full_mask, output_hidden_states=True)
    h = out.hidden_states[-1][:, P - 1:-1]
    w = model.get_output_embeddings().weight
    # h is the head's input (no logit multiplier in these tiny models)
    torch.testing.assert_close(h @ w.T, out.logits[:, P - 1:-1])
    return (h.abs() @ w.abs().T).max().item()


def differences(plain, shared) -> tuple[float, float]:
    """(largest |difference| of the steps' logits, smallest top-2 margin of plain's steps)."""
    diff = max((a - b).abs().max().item() for a, b in zip(plain.logits, shared.logits))
    margin = min((lambda top: (top.values[:, 0] - top.values[:, 1]).min().item())(step.topk(2, dim=-1))
                 for step in plain.logits)
    return diff, margin


@pytest.fixture
def expanded_layers(monkeypatch):
    """The cache layers the shared prefill handed on, per call: [(type name, batch sizes of its states)]."""
    seen = []
    prefill = generation.prefill_shared_prompts

    def spy(model, groups):
        cache = prefill(model, groups)
        seen.append([(type(layer).__name__, _rows(layer)) for layer in cache.layers])
        return cache

    monkeypatch.setattr(generation, "prefill_shared_prompts", spy)
    return seen


def _rows(layer) -> set[int]:
    sizes = set()
    if isinstance(layer, RECURRENT_LAYERS):
        states = [*layer.conv_states.values(), *layer.recurrent_states.values()]
        sizes |= {int(s.shape[0]) for s in states if s is not None}
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.numel():
        sizes.add(int(keys.shape[0]))
    return sizes


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_greedy_generation_equals_plain_generate(family, expanded_layers):
    """fp32: logits within K_FORWARD eps32 x the dot scale, token ids equal; every recurrent state at N rows."""
    model = tiny_hybrid_lm(family)
    ids, mask = prompt_batch()
    plain, shared, _, route = both_ways(model, ids, mask, greedy_config())
    diff, margin = differences(plain, shared)
    scale = logit_scale(model, plain.sequences, mask)
    print(f"REPORT {family}: logits {diff / (EPS32 * scale):.2f} eps32 x dot scale {scale:.2f} "
          f"({diff / (EPS32 * plain.logits[0].abs().max().item()):.2f} x max|logit|), margin {margin:.3g}")
    bound = (diff if family in OWN_ROUNDING else K_FORWARD * EPS32 * scale)
    assert diff <= K_FORWARD * EPS32 * scale or family in OWN_ROUNDING, (diff, scale)
    assert margin > 2 * bound, (margin, bound)  # the argmax compared where it cannot tie
    assert torch.equal(plain.sequences, shared.sequences)
    (layers,) = expanded_layers
    recurrent = [rows for name, rows in layers if name in {c.__name__ for c in RECURRENT_LAYERS}]
    assert recurrent and all(rows == {ids.shape[0]} for rows in recurrent), layers
    # three prompts prefilled once each (their first P - 1 columns), then each row's last column
    assert route.count.ran_tokens == int(mask[:3, :-1].sum()) + ids.shape[0] < route.count.trl_tokens


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2", "nemotron_h", "falcon_h1"])
def test_a_one_token_prompt_prefills_from_padding_only(family):
    """Prompts of 3 and 1 tokens: the one-token prompt's two prefilled columns are padding, which the recurrent
    layers zero by the 2D mask (its state stays the zero state), then its one token decodes from it."""
    model = tiny_hybrid_lm(family)
    ids, mask = prompt_batch(lengths=(3, 1), copies=2)
    plain, shared, _, route = both_ways(model, ids, mask, greedy_config())
    diff, margin = differences(plain, shared)
    scale = logit_scale(model, plain.sequences, mask)
    assert diff <= K_FORWARD * EPS32 * scale and margin > 2 * K_FORWARD * EPS32 * scale, (diff, margin, scale)
    assert torch.equal(plain.sequences, shared.sequences)
    assert route.count.ran_tokens == 2 + ids.shape[0]  # the 3-token prompt's first 2, then every row's last


@pytest.mark.parametrize("family,dtype", [("lfm2", torch.float64), ("qwen3_5_text", torch.float32),
                                          ("nemotron_h", torch.float32)])
def test_sampled_generation_equals_plain_generate(family, dtype):
    """TRL's sampling options and some rows ending early: the same tokens and the same random state after. LFM2 in
    float64 (it casts nothing to float32: its logits agree to the bit here); Qwen3.5 and NemotronH in fp32, where a
    token could flip only if a draw fell within ~1e-6 of a boundary between two tokens' probabilities (module doc)."""
    model = tiny_hybrid_lm(family, dtype=dtype)
    ids, mask = prompt_batch(lengths=(7, 3), copies=4, seed=2)
    config = greedy_config(12, do_sample=True, temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1,
                           eos_token_id=[EOS, *range(40, 50)])
    plain, shared, (rng_plain, rng_shared), _ = both_ways(model, ids, mask, config)
    assert torch.equal(plain.sequences, shared.sequences) and torch.equal(rng_plain, rng_shared)
    new = plain.sequences[:, ids.shape[1]:]
    assert (new == PAD).any()  # rows that ended are padded
    diff, _ = differences(plain, shared)
    scale = logit_scale(model, plain.sequences, mask)
    print(f"REPORT sampled {family} {dtype}: logits {diff / (torch.finfo(dtype).eps * scale):.2f} eps x dot scale")
    assert diff <= K_FORWARD * torch.finfo(dtype).eps * scale, (diff, scale)


def first_step_logits(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The last prompt column's logits [N, V] in the model's dtype (generate hands them out as fp32): one forward of
    the whole prompts, and the shared prefill's cache then one forward of that column (generate's first step)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        cache = generation.prefill_shared_prompts(model, group_prompt_rows(ids, mask))
        step = model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions[:, -1:],
                     **{generation.cache_kwarg(model): cache}).logits[:, -1]
    return whole, step


class _Float64Torch(types.ModuleType):
    """`torch` as a modeling module sees it, with float32 meaning float64."""

    float32 = float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@pytest.mark.parametrize("family", sorted(OWN_ROUNDING))
def test_own_rounding_families_agree_in_float64_without_float32_casts(family, monkeypatch):
    """Why fp32 rounding alone moves an `OWN_ROUNDING` family's logits that far: in float64 with every float32
    cast of its modeling code lifted (its Gated DeltaNet rules, norms, rotary and softmax run in float64), the last
    prompt column's logits of the shared prefill and of the whole prompts agree within K_FORWARD eps64 x the dot
    scale (measured 4.2)."""
    model = tiny_hybrid_lm(family)
    model.set_experts_implementation("eager")  # the grouped matmul has no float64
    model = model.double()
    monkeypatch.setattr(sys.modules[type(model).__module__], "torch", _Float64Torch("torch"))
    cast = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t, *a, **k: t if t.dtype == torch.float64 else cast(t, *a, **k))
    ids, mask = prompt_batch()
    whole, step = first_step_logits(model, ids, mask)
    assert whole.dtype == torch.float64
    scale = logit_scale(model, torch.cat([ids, ids[:, :1]], dim=1), mask)  # h at the last prompt column
    diff = (whole - step).abs().max().item()
    print(f"REPORT {family} float64 without float32 casts: {diff / (EPS64 * scale):.2f} eps64 x dot scale")
    assert diff <= K_FORWARD * EPS64 * scale, (diff, scale)


@pytest.fixture
def merged_calls(monkeypatch):
    """How many attention calls merged a prompt held once (`SharedPromptLayer.attend`); the size rule off."""
    from prefixdpo.core.attention.shared_prompt import SharedPromptLayer

    monkeypatch.setattr(generation, "MIN_SHARED_PROMPT_BYTES", 0)  # these tiny prompts' copies are below the size
    calls = {"merged": 0}
    attend = SharedPromptLayer.attend

    def counting(self, *args):
        out = attend(self, *args)
        calls["merged"] += out is not None
        return out

    monkeypatch.setattr(SharedPromptLayer, "attend", counting)
    return calls


@pytest.mark.parametrize("family,held_once", [("qwen3_5_text", True), ("lfm2", True), ("nemotron_h", True),
                                              ("falcon_h1", False), ("kimi_linear", False)])
def test_policy_on_prefixdpos_attention_holds_prompts_once_beside_recurrent_states(family, held_once, merged_calls):
    """A GRPO policy as the trainer prepares it (prefixdpo's attention, its recurrent mixers wrapped): its attention
    layers hold each prompt once and merge it at every step (the decoding plan reaches the wrapped mixers too, which
    then decode stock from their expanded states), against plain generate of the stock model. Falcon-H1 (attention
    and Mamba2 state in one layer object) and Kimi Linear (MLA: the cache holds latents) keep a copy per row."""
    from prefixdpo.core.model_checks import prepare_model

    stock, policy = tiny_hybrid_lm(family), tiny_hybrid_lm(family)
    prepare_model(policy, "sdpa")
    ids, mask = prompt_batch()
    plain = stock.generate(input_ids=ids, attention_mask=mask, generation_config=greedy_config())
    _, shared, _, _ = both_ways(policy, ids, mask, greedy_config())
    diff, margin = differences(plain, shared)
    scale = logit_scale(stock, plain.sequences, mask)
    assert diff <= K_FORWARD * EPS32 * scale and margin > 2 * K_FORWARD * EPS32 * scale, (diff, margin, scale)
    assert torch.equal(plain.sequences, shared.sequences)
    attention_layers = sum(type(layer).__name__ == "DynamicLayer"
                           for layer in DynamicCache(config=stock.config).layers)
    assert merged_calls["merged"] == (attention_layers * len(plain.logits) if held_once else 0)


def _tiny(model_type: str, **fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**common, **fields})).eval()


def test_why_not_shared_names_each_hybrid_it_cannot_prefill_once():
    """Measured before the refusals: tiny Mamba (1), FalconMamba and RecurrentGemma models generated other tokens
    (logits ~1e7 eps apart) with the shared prefill; each reason names the mixer type."""
    ids, mask = prompt_batch()
    inputs = {"input_ids": ids, "attention_mask": mask}
    config = greedy_config()
    mamba = _tiny("mamba", state_size=8, expand=1, conv_kernel=4)
    assert "MambaMixer: multiplies its input by generate's whole 2D padding mask" in why_not_shared(
        mamba, config, inputs)
    gemma = _tiny("recurrent_gemma", lru_width=64, attention_window_size=32, block_types=["recurrent", "attention"])
    assert "RecurrentGemmaRecurrentBlock: keeps its convolution and RG-LRU states on the module" in why_not_shared(
        gemma, config, inputs)
    # measured before this refusal, Zamba2's first logits 1.6e-5 apart in float64 without float32 casts (4.2 eps64 x
    # the dot scale with its chunked scan's time-step clamp lifted): the step and the scan differ in the model itself
    zamba2 = tiny_hybrid_lm("zamba2")
    assert "Zamba2MambaMixer: clamps its time step at time_step_min in its chunked scan" in why_not_shared(
        zamba2, config, inputs)
    olmo = _tiny("olmo_hybrid")
    assert "OlmoHybridGatedDeltaNet: has no test of the shared prefill" in why_not_shared(olmo, config, inputs)
    qwen = tiny_hybrid_lm("qwen3_5_text")
    assert why_not_shared(qwen, config, inputs) is None
    right = {"input_ids": ids, "attention_mask": mask.flip(1)}
    assert "last column is padding" in why_not_shared(qwen, config, right)
    # measured before this refusal: prompts of 2 and 1 tokens generated other tokens (logits ~7 apart)
    short_ids, short_mask = prompt_batch(lengths=(2, 1))
    assert "one-column prefill of 2-column prompts holds padding" in why_not_shared(
        qwen, config, {"input_ids": short_ids, "attention_mask": short_mask})
    layers = DynamicCache(config=qwen.config).layers
    assert unshared_mixers(torch.nn.Linear(2, 2), layers) == {"": "its recurrent layers are of no type prefixdpo knows"}
    assert unshared_mixers(torch.nn.Linear(2, 2), layers[1:2]) == {}  # attention only


@pytest.mark.parametrize("prefix_sharing,held_once", [(False, False), (True, False), (True, True)])
def test_grpo_rollouts_equal_trl_with_each_prompt_prefilled_once(prefix_sharing, held_once, tmp_path, caplog,
                                                                 monkeypatch):
    """4 GRPO steps on Qwen3.5 (Gated DeltaNet beside attention), prefix sharing off (TRL's passes) and on (shared
    lines, the recurrent mixers wrapped): TRL's GRPOTrainer's completions exactly, generated with each prompt's first
    P - 1 columns prefilled once for its 2 rows (the saving logged every step, no fallback said). held_once: the size
    rule off, so the policy's attention layers decode over prompts held once beside the expanded recurrent states."""
    import logging

    from prefixdpo.core.attention.shared_prompt import SharedPromptLayer

    merged = []
    if held_once:
        monkeypatch.setattr(generation, "MIN_SHARED_PROMPT_BYTES", 0)
        attend = SharedPromptLayer.attend
        monkeypatch.setattr(SharedPromptLayer, "attend",
                            lambda self, *args: merged.append(attend(self, *args)) or merged[-1])

    from test_grpo_trl_parity import run
    from test_hybrid_unshared import _hybrid, tokenizer
    from trl import GRPOConfig, GRPOTrainer

    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer

    folder = tmp_path / "qwen3_5_text"
    _hybrid("qwen3_5_text").save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    options = dict(loss_type="grpo", beta=0.04, num_iterations=1, num_generations=2, per_device_train_batch_size=4)
    _, theirs, _, _ = run(GRPOTrainer, GRPOConfig, folder, tmp_path / "trl", **options)
    with caplog.at_level(logging.WARNING, logger="prefixdpo.grpo"):
        logs, ours, _, _ = run(PrefixGRPOTrainer, PrefixGRPOConfig, folder, tmp_path / "ours",
                               prefix_sharing=prefix_sharing, **options)
    assert not [r for r in caplog.records if "shared-prompt generation" in r.getMessage()]
    assert len(theirs) == 4 and theirs == ours
    saved = [step["prefix_sharing/prefill_tokens_saved"] for step in logs]
    print(f"REPORT grpo qwen3_5_text prefix_sharing={prefix_sharing}: prefill tokens saved {saved}")
    assert len(saved) == 4 and all(s > 0.3 for s in saved)
    assert (sum(out is not None for out in merged) > 0) == held_once
