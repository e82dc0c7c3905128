"""Shared-prompt generation (`grpo/generation.py`) == TRL's transformers generate, token for token.

How sampling is compared without comparing at a tie: the sampled tests run the model in float64. transformers casts
each step's logits to fp32 before sampling, so the shared prefill's last-bit differences (~1e-16 relative) reach
the sampler only where a logit sits on an fp32 rounding boundary, and then flip a token only if the uniform draw
falls within ~1e-7 of a boundary between two tokens' probabilities: far too rare to meet (in fp32 a flip would need
a draw within the fp32 logits' ~1e-6 differences, ~1e-3 over these tests' draws). The fp32 test decodes greedily
and first asserts that every step's top-2 margin exceeds twice the logit tolerance, so its argmax cannot tie.
Tolerances: logits agree within 1e-5 x the largest |logit| (fp32) or 8 x eps32 x it (float64 logits cast to fp32).
"""

from __future__ import annotations

import logging

import pytest
import torch
from grpo_common import prompt_dataset, reward_vowels, saved_tiny_model, tiny_causal_lm, tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig

from prefixdpo.grpo.generation import SharedPromptRoute, generate_routed, group_prompt_rows, why_not_shared

EPS32 = torch.finfo(torch.float32).eps
# tokens that end a completion besides EOS: ~10% of the vocabulary, so some rows stop within the budget
ENDING = list(range(40, 80))


def prompt_batch(lengths=(9, 4, 6), copies=3, seed=0):
    """Left-padded rows [N, P]: each prompt `copies` times, interleaved (p0 p1 p2 p0 ...): grouping is by content."""
    tok = tokenizer()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in lengths]
    rows = [p for _ in range(copies) for p in prompts]
    P = max(lengths)
    ids = torch.tensor([[tok.pad_token_id] * (P - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def sampling_config(**overrides) -> GenerationConfig:
    tok = tokenizer()
    options = dict(max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                   pad_token_id=tok.pad_token_id, eos_token_id=[tok.eos_token_id, *ENDING],
                   return_dict_in_generate=True, output_logits=True)
    return GenerationConfig(**{**options, **overrides})


def both_ways(model, ids, mask, config, seed=1):
    """(cold, shared, rng state after each, route): transformers' generate as TRL calls it, and the routed one."""
    notes = []
    route = SharedPromptRoute(notes.append)
    torch.manual_seed(seed)
    cold = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    cold_rng = torch.get_rng_state()
    torch.manual_seed(seed)
    with generate_routed(model, route):
        shared = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert "generate" not in vars(model)  # the route is gone after
    assert notes == []  # it really shared
    return cold, shared, (cold_rng, torch.get_rng_state()), route


def prepared(model):
    """The model on prefixdpo's attention, as a GRPO/RLOO policy is: decoding then reads each prompt once."""
    from prefixdpo.core.model_checks import prepare_model

    prepare_model(model, "sdpa")
    return model


@pytest.fixture
def cascade_calls(monkeypatch):
    """How many attention calls the shared-prompt layer merged, and how many ran over gathered whole rows."""
    from prefixdpo.core.attention.shared_prompt import SharedPromptLayer
    from prefixdpo.grpo import generation

    monkeypatch.setattr(generation, "MIN_SHARED_PROMPT_BYTES", 0)  # these tiny prompts' copies are below the size
    calls = {"merged": 0, "whole": 0}
    attend, whole = SharedPromptLayer.attend, SharedPromptLayer.whole_rows

    def counting_attend(self, *args):
        out = attend(self, *args)
        calls["merged"] += out is not None
        return out

    def counting_whole(self, *args):
        calls["whole"] += 1
        return whole(self, *args)

    monkeypatch.setattr(SharedPromptLayer, "attend", counting_attend)
    monkeypatch.setattr(SharedPromptLayer, "whole_rows", counting_whole)
    return calls


def max_logit_difference(a, b) -> tuple[float, float]:
    """(largest |difference| of per-step logits, largest |logit|)."""
    diff = max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))
    return diff, max(x.abs().max().item() for x in a.logits)


def test_sampled_completions_equal_trl_generate_float64():
    model = tiny_causal_lm().double()
    ids, mask = prompt_batch()
    cold, shared, (rng_cold, rng_shared), route = both_ways(model, ids, mask, sampling_config())
    assert torch.equal(cold.sequences, shared.sequences)
    assert torch.equal(rng_cold, rng_shared)  # the same number of random draws: later steps sample the same
    diff, scale = max_logit_difference(cold, shared)
    assert diff <= 8 * EPS32 * scale, (diff, scale)
    new = cold.sequences[:, ids.shape[1]:]
    ended = torch.isin(new, torch.tensor([tokenizer().eos_token_id, *ENDING]))
    assert ended.any(1).any() and not ended.any(1).all()  # some rows stop within the budget, some run to it
    assert (new == tokenizer().pad_token_id).any()  # and finished rows are padded, as in TRL's batch
    # the three prompts prefilled once each (their first P - 1 columns), then each row's last column
    assert route.count.ran_tokens == int(mask[:3, :-1].sum()) + ids.shape[0] < route.count.trl_tokens


@pytest.mark.parametrize("held_once", [False, True], ids=["stock-attention", "prompts-held-once"])
def test_greedy_completions_and_logits_equal_trl_generate_float32(held_once, cascade_calls):
    """On the model's stock attention (the cache a copy per row) and on prefixdpo's (prompts held once)."""
    model = prepared(tiny_causal_lm()) if held_once else tiny_causal_lm()
    ids, mask = prompt_batch(lengths=(11, 3, 7, 7), copies=2, seed=3)
    config = sampling_config(do_sample=False, temperature=None, top_k=None, top_p=None,
                             eos_token_id=tokenizer().eos_token_id)
    cold, shared, _, _ = both_ways(model, ids, mask, config)
    diff, scale = max_logit_difference(cold, shared)
    tolerance = 1e-5 * scale
    assert diff <= tolerance, (diff, scale)
    # argmax compared only where it cannot tie: every step's top-2 margin is far above the logits' difference
    margins = [(lambda top: (top.values[:, 0] - top.values[:, 1]).min().item())(step.topk(2, dim=-1))
               for step in cold.logits]
    assert min(margins) > 2 * tolerance, min(margins)
    assert torch.equal(cold.sequences, shared.sequences)
    assert (cascade_calls["merged"] > 0) == held_once and cascade_calls["whole"] == 0


def test_repetition_penalty_and_min_p_apply_unchanged_float64():
    """TRL's options that read the prompt ids (repetition penalty) or reshape the distribution (min-p, top-k)."""
    model = tiny_causal_lm().double()
    ids, mask = prompt_batch(lengths=(5, 8), copies=4, seed=5)
    config = sampling_config(repetition_penalty=1.3, min_p=0.05, top_k=50, temperature=0.7)
    cold, shared, (rng_cold, rng_shared), _ = both_ways(model, ids, mask, config)
    assert torch.equal(cold.sequences, shared.sequences) and torch.equal(rng_cold, rng_shared)


def test_rows_group_by_ids_and_padding():
    """A real token equal to the pad id at a padding column is another prompt: same ids, other mask."""
    pad = tokenizer().pad_token_id
    ids = torch.tensor([[pad, 5, 6], [pad, 5, 6], [pad, 5, 6], [7, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    groups = group_prompt_rows(ids, mask)
    assert groups.num_unique == 3
    inverse = groups.row_to_unique.tolist()
    assert inverse[0] == inverse[2] and len({inverse[0], inverse[1], inverse[3]}) == 3
    assert torch.equal(groups.input_ids[groups.row_to_unique], ids)
    assert torch.equal(groups.attention_mask[groups.row_to_unique], mask)


def test_why_not_shared_names_each_inexact_case():
    model = tiny_causal_lm()
    ids, mask = prompt_batch()
    inputs = {"input_ids": ids, "attention_mask": mask}
    plain = sampling_config()
    assert why_not_shared(model, plain, inputs) is None
    assert "beam" in why_not_shared(model, sampling_config(num_beams=2), inputs)
    assert "static" in why_not_shared(model, sampling_config(cache_implementation="static"), inputs)
    assert "pixel_values" in why_not_shared(model, plain, {**inputs, "pixel_values": torch.zeros(1)})
    assert "cache off" in why_not_shared(model, sampling_config(use_cache=False), inputs)
    assert "one column" in why_not_shared(model, plain, {"input_ids": ids[:, -1:], "attention_mask": mask[:, -1:]})
    dropout = tiny_causal_lm(attention_dropout=0.1).train()
    assert "dropout" in why_not_shared(dropout, plain, inputs)
    assert why_not_shared(dropout.eval(), plain, inputs) is None
    assert "random numbers" in why_not_shared(tiny_causal_lm(router_jitter_noise=0.1).train(), plain, inputs)
    windowed = tiny_causal_lm("mistral", sliding_window=4)
    assert "sliding window of 4" in why_not_shared(windowed, plain, inputs)


def test_sliding_window_model_within_its_window_float64():
    model = tiny_causal_lm("mistral", sliding_window=64).double()
    ids, mask = prompt_batch(lengths=(9, 4), copies=3)
    cold, shared, (rng_cold, rng_shared), _ = both_ways(model, ids, mask, sampling_config())
    assert torch.equal(cold.sequences, shared.sequences) and torch.equal(rng_cold, rng_shared)


# ---- decoding over prompts held once (core.attention.shared_prompt) --------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoding_over_prompts_held_once_samples_as_trl_float64(arch, cascade_calls):
    """Every decode step of every layer merges the prompt part (one matmul per prompt over its 3 rows) with the rows'
    own part; a one-token prompt's cached part is all padding (its prompt part attends to nothing). Qwen2: GQA."""
    model = prepared(tiny_causal_lm(arch).double())
    ids, mask = prompt_batch(lengths=(9, 1, 6), copies=3)
    cold, shared, (rng_cold, rng_shared), _ = both_ways(model, ids, mask, sampling_config())
    assert torch.equal(cold.sequences, shared.sequences) and torch.equal(rng_cold, rng_shared)
    diff, scale = max_logit_difference(cold, shared)
    assert diff <= 8 * EPS32 * scale, (diff, scale)
    layers = model.config.num_hidden_layers
    assert cascade_calls == {"merged": layers * len(cold.logits), "whole": 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_attention_equals_attention_over_whole_rows(dtype):
    """One decode step's merge (3 prompts x 4 rows, GQA 4 query heads per KV head, left-padded prompts, one all
    padding) against SDPA over each row's [prompt | own] keys: within K_FORWARD eps(dtype) of the values' scale
    (the output is a convex combination of values). bf16: the cache read in bf16, the softmax in fp32."""
    from tolerances import K_FORWARD, assert_within

    from prefixdpo.core.attention.shared_prompt import SharedPromptLayer

    g = torch.Generator().manual_seed(4)
    U, G, Hkv, groups, P, s, D = 3, 4, 2, 4, 9, 5, 16
    N, H = U * G, Hkv * groups
    valid = torch.ones(U, P, dtype=torch.bool)
    valid[1, :4], valid[2, :] = False, False  # left padding; the third prompt's cached part is all padding
    rows = torch.arange(N) % U  # interleaved, as TRL's sampler deals them
    keys, values = (torch.randn(U, Hkv, P, D, generator=g).to(dtype) for _ in range(2))
    layer = SharedPromptLayer(keys, values, valid, rows)
    own_k, own_v = (torch.randn(N, Hkv, s, D, generator=g).to(dtype) for _ in range(2))
    query = torch.randn(N, H, 1, D, generator=g).to(dtype)
    mask = torch.cat([valid[rows], torch.ones(N, s, dtype=torch.bool)], dim=1)[:, None, None, :]
    merged = layer.attend(query, own_k, own_v, mask, {"scaling": D ** -0.5})
    whole_k, whole_v = layer.whole_rows(own_k, own_v)
    reference = torch.nn.functional.scaled_dot_product_attention(
        query.float(), whole_k.float(), whole_v.float(), attn_mask=mask, scale=D ** -0.5, enable_gqa=True)
    assert merged.dtype == dtype and merged.shape == (N, 1, H, D)
    assert_within(merged.float(), reference.transpose(1, 2), whole_v.float().abs().max().item(), dtype, k=K_FORWARD,
                  what="merged vs whole-row attention")


def test_prompts_of_unequal_row_counts_attend_over_gathered_rows_float64(cascade_calls):
    """A prompt with 3 rows beside one with 2: the merge needs equal groups, so each layer gathers the prompts'
    keys per row in front of the own ones and runs the ordinary attention (same numbers, no saving)."""
    model = prepared(tiny_causal_lm().double())
    ids, mask = prompt_batch(lengths=(5, 8), copies=2, seed=7)
    ids, mask = torch.cat([ids, ids[:1]]), torch.cat([mask, mask[:1]])
    cold, shared, (rng_cold, rng_shared), _ = both_ways(model, ids, mask, sampling_config())
    assert torch.equal(cold.sequences, shared.sequences) and torch.equal(rng_cold, rng_shared)
    assert cascade_calls["merged"] == 0 and cascade_calls["whole"] == model.config.num_hidden_layers * len(cold.logits)


def test_prompts_held_once_only_where_their_copies_are_large_enough():
    """Copies under MIN_SHARED_PROMPT_BYTES per layer decode faster than the merge's extra operations (measured):
    kept; models off prefixdpo's attention keep them too."""
    from prefixdpo.core.attention.shared_prompt import SharedPromptLayer
    from prefixdpo.grpo import generation

    model = prepared(tiny_causal_lm())
    ids, mask = prompt_batch(lengths=(9, 4, 6), copies=3)
    groups = group_prompt_rows(ids, mask)
    cache = generation.prefill_shared_prompts(model, groups)
    assert not any(isinstance(layer, SharedPromptLayer) for layer in cache.layers)
    assert cache.layers[0].keys.shape[0] == ids.shape[0]  # a copy per row
    assert "bytes per layer" in generation.why_not_shared_cache(model, cache, groups)
    generation.MIN_SHARED_PROMPT_BYTES, before = 0, generation.MIN_SHARED_PROMPT_BYTES
    try:
        held = generation.prefill_shared_prompts(model, groups)
        assert all(isinstance(layer, SharedPromptLayer) and layer.prompt_keys.shape[0] == 3 for layer in held.layers)
        stock = generation.prefill_shared_prompts(tiny_causal_lm(), groups)
        assert not any(isinstance(layer, SharedPromptLayer) for layer in stock.layers)
    finally:
        generation.MIN_SHARED_PROMPT_BYTES = before


def test_a_model_whose_attention_drops_the_shared_prompt_stops(monkeypatch):
    """Keys changed between the cache update and prefixdpo's attention would attend to the rows' own columns
    only: the layer notices at the next step (or after generate) and stops in one line. Prompts without padding:
    transformers then passes no mask, which with padding would not match the keys' length and fail at once."""
    from prefixdpo.core.attention import backends

    from prefixdpo.grpo import generation

    monkeypatch.setattr(generation, "MIN_SHARED_PROMPT_BYTES", 0)
    model = prepared(tiny_causal_lm())
    ids, mask = prompt_batch(lengths=(6, 6))
    original = backends._line_attention

    def losing(module, query, key, value, plan, **kwargs):
        return original(module, query, key.clone(), value, plan, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backends, "_line_attention", losing)
        with pytest.raises(RuntimeError, match="did not read the shared prompt"), \
                generate_routed(model, SharedPromptRoute(lambda note: None)):
            model.generate(input_ids=ids, attention_mask=mask, generation_config=sampling_config())


# ---- through the trainers, against TRL's own -------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny-gen") / "model")


def run_trainer(trainer_cls, config_cls, model_dir, out_dir, *, dtype=torch.float64, steps=3, **options):
    """`steps` optimizer steps; -> (completion ids of every reward call, logged steps)."""
    torch.set_num_threads(1)
    rollouts = []

    def reward(completions, completion_ids, **kwargs):
        rollouts.append([list(ids) for ids in completion_ids])
        return reward_vowels(completions)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.generation_config.eos_token_id = [tokenizer().eos_token_id, *ENDING]  # TRL ends completions at each
    args = config_cls(output_dir=str(out_dir), max_steps=steps, logging_steps=1, learning_rate=0.5, optim="sgd",
                      lr_scheduler_type="constant", use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      seed=0, disable_tqdm=True, max_completion_length=10, gradient_checkpointing=False,
                      num_generations=4, per_device_train_batch_size=8, **options)
    trainer = trainer_cls(model=model, reward_funcs=reward, args=args, train_dataset=prompt_dataset(32),
                          processing_class=tokenizer())
    trainer.train()
    return rollouts, [h for h in trainer.state.log_history if "loss" in h]


def _ended_early(rollouts) -> bool:
    return any(len(ids) < 10 for step in rollouts for ids in step)


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_trainer_completions_equal_trl_float64(method, model_dir, tmp_path, caplog, cascade_calls):
    """The policy on prefixdpo's attention decodes over prompts held once (every step merged, the size rule off)."""
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer, PrefixRLOOConfig, PrefixRLOOTrainer

    theirs_cls, ours_cls = ((GRPOTrainer, GRPOConfig), (PrefixGRPOTrainer, PrefixGRPOConfig)) if method == "grpo" \
        else ((RLOOTrainer, RLOOConfig), (PrefixRLOOTrainer, PrefixRLOOConfig))
    theirs, _ = run_trainer(*theirs_cls, model_dir, tmp_path / "trl", beta=0.0)
    with caplog.at_level(logging.WARNING, logger="prefixdpo.grpo"):
        ours, logs = run_trainer(*ours_cls, model_dir, tmp_path / "ours", beta=0.0)
    assert not [r for r in caplog.records if "shared-prompt generation" in r.getMessage()]
    assert len(theirs) == 3 and theirs == ours
    assert cascade_calls["merged"] > 0 and cascade_calls["whole"] == 0
    assert _ended_early(theirs)  # EOS (or another ending id) within the budget in some rows
    # two prompts of different lengths per batch (left padding), each prefilled once instead of 4 times
    assert all(step["prefix_sharing/prefill_tokens_saved"] > 0.5 for step in logs)


def test_trainer_falls_back_to_trl_generate_and_says_why(model_dir, tmp_path, caplog):
    from trl import GRPOConfig, GRPOTrainer

    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer

    theirs, _ = run_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", steps=2, beta=0.0,
                            cache_implementation="static")
    with caplog.at_level(logging.WARNING, logger="prefixdpo.grpo"):
        ours, logs = run_trainer(PrefixGRPOTrainer, PrefixGRPOConfig, model_dir, tmp_path / "ours", steps=2,
                                 beta=0.0, cache_implementation="static")
    said = [r.getMessage() for r in caplog.records if "shared-prompt generation" in r.getMessage()]
    assert len(said) == 1 and "cache_implementation='static'" in said[0]  # once, for both steps
    assert theirs == ours
    assert not any("prefix_sharing/prefill_tokens_saved" in step for step in logs)


def test_trainer_option_off_runs_trl_generate(model_dir, tmp_path):
    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer

    _, logs = run_trainer(PrefixGRPOTrainer, PrefixGRPOConfig, model_dir, tmp_path / "off", steps=1, beta=0.0,
                          shared_prompt_generation=False)
    assert not any("prefix_sharing/prefill_tokens_saved" in step for step in logs)


def test_use_vllm_says_what_shares_the_prompts(caplog):
    """With use_vllm nothing is routed; the start says whether vLLM's prefix caching shares the G copies."""
    from types import SimpleNamespace as NS

    from prefixdpo.grpo.rollout import _say_vllm_prefix_caching

    def trainer(mode, caching):
        config = NS(cache_config=NS(enable_prefix_caching=caching))
        return NS(args=NS(vllm_mode=mode), vllm_generation=NS(llm=NS(llm_engine=NS(vllm_config=config))))

    with caplog.at_level(logging.INFO, logger="prefixdpo.grpo"):
        _say_vllm_prefix_caching(trainer("colocate", False))
        _say_vllm_prefix_caching(trainer("colocate", True))
        _say_vllm_prefix_caching(trainer("server", None))
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said[0][0] == "WARNING" and "prefix caching is off" in said[0][1]
    assert len(said) == 2 and "sends each prompt once with n=num_generations" in said[1][1]
