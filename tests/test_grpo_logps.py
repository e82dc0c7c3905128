"""The per-token log-prob pass of `PrefixGRPOTrainer` / `PrefixRLOOTrainer` against TRL 1.16's own method on the
same trainer, model and rows (the stock SDPA attention for TRL's pass).

Rows: three prompt groups shuffled together (a group's rows are not adjacent), prompts left-padded by TRL's
rule, completions of 1..14 tokens ending at EOS, cut at the width, and one fully masked. Asserted (fp32,
`tolerances`): log-probs and entropies within K_FORWARD eps of their largest |value|, and the gradients of a
weighted sum of both within K eps of the largest gradient entry; for a rotary (llama), an absolute-position
(gpt2, positions = columns) and a mask-counted-position (opt) model, with and without packing, at temperature 1 and 0.7, one forward and TRL's chunked
forwards, dense-mask SDPA and segmented attention; the MoE load-balancing loss of one and of chunked forwards
(qwen3-moe) within K_FORWARD eps of its size; a pass prefix sharing cannot reproduce runs TRL's own method, bit for
bit, with one log line; the segmented-attention plan a GRPO pass builds equals dense-mask SDPA at the attention level
(outputs within K_FORWARD eps of the largest |value|, gradients K eps of their largest entry; also in float64).
"""

from __future__ import annotations

import logging

import pytest
import torch
from grpo_common import prompt_dataset, reward_vowels, rows_with_groups, tiny_causal_lm, tokenizer
from trl import GRPOTrainer

from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer
from prefixdpo.grpo.layout import layout_groups, why_not_shared
from tolerances import K_FORWARD, assert_within, float64_model


def make_trainer(tmp_path, model, **options):
    torch.set_num_threads(1)  # tiny models; conftest's fixture restores the thread count
    args = PrefixGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=14, use_cpu=True, bf16=False, report_to="none",
                            gradient_checkpointing=False, **options)
    return PrefixGRPOTrainer(model=model, reward_funcs=reward_vowels, args=args, train_dataset=prompt_dataset(4),
                             processing_class=tokenizer())


def trl_pass(trainer, **kwargs):
    """TRL 1.16's own method on the same trainer, with the model's stock SDPA attention."""
    model = trainer.model
    model.set_attn_implementation("sdpa")
    try:
        return GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, **kwargs)
    finally:
        model.set_attn_implementation("prefixdpo")


def values_and_grads(pass_fn, model, weights):
    """(log-probs, entropies, gradient of sum(w0 * logps + w1 * entropies) per parameter)."""
    model.zero_grad(set_to_none=True)
    logps, entropies, _ = pass_fn()
    ((logps * weights[0]).sum() + (entropies * weights[1]).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), entropies.detach(), grads


@pytest.mark.parametrize("arch,packing,temperature,batch_size,attention", [
    ("llama", True, 0.7, None, "sdpa"),
    ("llama", False, 1.0, 3, "segmented"),
    ("gpt2", True, 1.0, None, "sdpa"),
    ("opt", False, 0.7, 3, "sdpa"),
    # a sliding window of 8 shorter than the rows: the dense mask slides it over the shared lines (masks.dense_mask)
    (("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)), True, 1.0, None, "sdpa"),
    (("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)), False, 1.0, 3, "segmented"),
])
def test_logps_entropies_and_grads_equal_trl(tmp_path, arch, packing, temperature, batch_size, attention):
    arch, config = arch if isinstance(arch, tuple) else (arch, {})
    trainer = make_trainer(tmp_path, tiny_causal_lm(arch, **config), packing=packing, temperature=temperature,
                           attention=attention)
    model = trainer.model
    input_ids, attention_mask, K = rows_with_groups()
    call = dict(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=K, batch_size=batch_size,
                compute_entropy=True)
    weights = torch.randn(2, *input_ids.shape[:1], K, generator=torch.Generator().manual_seed(1))
    ours = values_and_grads(lambda: trainer._get_per_token_logps_and_entropies(model, **call), model, weights)
    theirs = values_and_grads(lambda: trl_pass(trainer, **call), model, weights)

    scored = attention_mask[:, -K:].bool()
    assert scored.sum() > 40 and (theirs[0][scored] < -1).all()  # a real pass: many tokens, none trivially certain
    assert torch.equal(ours[0][~scored], torch.zeros_like(ours[0][~scored]))  # zero where TRL's is zero
    assert_within(ours[0], theirs[0], theirs[0].abs().max().item(), k=K_FORWARD, what="log-probs")
    assert_within(ours[1], theirs[1], theirs[1].abs().max().item(), k=K_FORWARD, what="entropies")
    assert ours[2].keys() == theirs[2].keys() and len(ours[2]) == len(list(model.parameters()))
    scale = max(g.abs().max().item() for g in theirs[2].values())
    assert scale > 1e-3
    ours_grads, their_grads = (torch.cat([g[n].flatten() for n in ours[2]]) for g in (ours[2], theirs[2]))
    assert_within(ours_grads, their_grads, scale, what="gradients")
    # the pass really shared: each prompt ran once
    lines = layout_groups(input_ids, attention_mask, K, packing=packing)
    assert lines.num_real_tokens == int(attention_mask.sum()) - (9 * 3 + 4 * 2 + 6 * 0)


def test_logps_entropies_and_grads_equal_trl_in_float64(tmp_path):
    """float64 (`tolerances.float64_model`), packed lines: TRL's fused head (`ChunkedLogProbFunction`, on both
    sides) computes log-probs and entropies in float32 from the float64 hidden states and sums the head weight's
    gradient over tokens in float32, so those agree to float32 rounding (the lines order tokens otherwise than
    TRL's rows); every other gradient agrees to float64 rounding, so fp32's differences are rounding only."""
    trainer = make_trainer(tmp_path, float64_model(tiny_causal_lm("llama")), packing=True, temperature=0.7)
    model = trainer.model
    input_ids, attention_mask, K = rows_with_groups()
    call = dict(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=K, compute_entropy=True)
    weights = torch.randn(2, *input_ids.shape[:1], K, generator=torch.Generator().manual_seed(1))
    ours = values_and_grads(lambda: trainer._get_per_token_logps_and_entropies(model, **call), model, weights)
    theirs = values_and_grads(lambda: trl_pass(trainer, **call), model, weights)
    assert_within(ours[0], theirs[0], theirs[0].abs().max().item(), k=K_FORWARD, what="log-probs (float32 head)")
    assert_within(ours[1], theirs[1], theirs[1].abs().max().item(), k=K_FORWARD, what="entropies (float32 head)")
    head = model.get_output_embeddings().weight
    for name, grad in theirs[2].items():
        dtype = torch.float32 if model.get_parameter(name) is head else torch.float64
        assert_within(ours[2][name], grad, grad.abs().max().item(), dtype, what=f"{name} gradient")


def test_no_grad_pass_equals_trl(tmp_path):
    trainer = make_trainer(tmp_path, tiny_causal_lm("llama"))
    input_ids, attention_mask, K = rows_with_groups(seed=3)
    with torch.no_grad():
        ours, none_entropy, none_aux = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, K, 2)
        theirs, _, _ = trl_pass(trainer, input_ids=input_ids, attention_mask=attention_mask,
                                logits_to_keep=K, batch_size=2)
    assert none_entropy is None and none_aux is None and not ours.requires_grad
    assert_within(ours, theirs, theirs.abs().max().item(), k=K_FORWARD, what="log-probs")


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True,
           router_aux_loss_coef=0.01, num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("batch_size", [None, 3])
def test_moe_aux_loss_equals_trl(tmp_path, batch_size):
    trainer = make_trainer(tmp_path, tiny_causal_lm("qwen3_moe", **MOE))
    assert trainer.aux_loss_enabled
    input_ids, attention_mask, K = rows_with_groups(seed=2)
    call = dict(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=K, batch_size=batch_size,
                compute_entropy=True, compute_aux_loss=True)
    ours = trainer._get_per_token_logps_and_entropies(trainer.model, **call)
    theirs = trl_pass(trainer, **call)
    assert ours[2].requires_grad and theirs[2] > 0
    # the aux loss: E x sum over experts of (routed fraction x mean probability), inputs O(1 / E): its size
    assert_within(ours[2].item(), theirs[2].item(), theirs[2].item(), k=K_FORWARD, what="aux loss")
    assert_within(ours[0], theirs[0], theirs[0].abs().max().item(), k=K_FORWARD, what="log-probs")


def test_groups_by_prompt_tokens_not_row_order():
    input_ids, attention_mask, K = rows_with_groups()
    lines = layout_groups(input_ids, attention_mask, K, packing=False)
    # three prompts -> three lines, whatever the row order; a row's group is the one whose prompt it carries
    assert lines.num_lines == 3
    prompts = [tuple(r[:-K][m[:-K].bool()].tolist()) for r, m in zip(input_ids, attention_mask)]
    by_group = {}
    for row, line in enumerate(lines.response_line.tolist()):  # one group per line here
        by_group.setdefault(line, set()).add(prompts[row])
    assert all(len(p) == 1 for p in by_group.values()) and len(by_group) == 3
    # positions are TRL's columns: a left-padded prompt starts where its first real token sits
    first = lines.position_ids[lines.spans[..., 0] >= 0].min()
    assert first == 0 and set(lines.position_ids.unique().tolist()) >= {5, 9 + K - 1}
    # reversing the rows changes nothing but the row numbers: each row's scored tokens and their predictors' tokens
    flipped = layout_groups(input_ids.flip(0), attention_mask.flip(0), K, packing=False)
    N = input_ids.shape[0]

    def per_row(layout, row):
        sel = layout.out_row == row
        return (layout.target_ids[sel].tolist(), layout.out_col[sel].tolist(),
                layout.input_ids[layout.target_line[sel], layout.target_col[sel]].tolist())

    assert flipped.num_lines == 3 and all(per_row(lines, r) == per_row(flipped, N - 1 - r) for r in range(N))


def test_layouts_that_are_not_reproduced_are_named():
    input_ids, attention_mask, K = rows_with_groups()
    assert why_not_shared(attention_mask, K) is None
    gap = attention_mask.clone()
    gap[0, -K:] = 1
    gap[0, -K + 1] = 0  # the second completion token masked, the rest attended
    assert "after a masked one" in why_not_shared(gap, K)
    orphan = attention_mask.clone()
    row = int((attention_mask[:, -K] == 1).nonzero()[0])
    orphan[row, -K - 1] = 0  # the prompt's last column, which predicts the completion's first token
    assert "follows a masked prompt column" in why_not_shared(orphan, K)
    assert "no prompt" in why_not_shared(attention_mask, input_ids.shape[1])


def test_fallback_is_trl_exactly_and_said_once(tmp_path, caplog):
    trainer = make_trainer(tmp_path, tiny_causal_lm("llama"))
    input_ids, attention_mask, K = rows_with_groups()
    token_type_ids = torch.zeros_like(input_ids)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="prefixdpo.grpo.trainer"):
        for _ in range(2):
            ours, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, K, token_type_ids=token_type_ids)
        theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, input_ids, attention_mask, K, token_type_ids=token_type_ids)
    assert torch.equal(ours, theirs)
    said = [r for r in caplog.records if "token_type_ids" in r.getMessage()]
    assert len(said) == 1 and "TRL's own layout" in said[0].getMessage()


def test_sliding_window_shorter_than_the_rows_runs_trls_pass_on_a_backend_without_windows(tmp_path, caplog,
                                                                                        monkeypatch):
    """A backend that does not slide a window over a shared line (FlashAttention varlen, CUDA only: segmented stands in
    for it here, taken off the backends that do) runs TRL's pass (sdpa's does slide it: the equality test)."""
    import prefixdpo.grpo.passes as passes

    monkeypatch.setattr(passes, "WINDOWED_BACKENDS", ("sdpa", "flex"))
    model = tiny_causal_lm("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    trainer = make_trainer(tmp_path, model, attention="segmented")
    input_ids, attention_mask, K = rows_with_groups()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="prefixdpo.grpo.trainer"):
        ours, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, K)
        theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, attention_mask, K)
    assert torch.equal(ours, theirs)
    assert any("sliding window of 8" in r.getMessage() for r in caplog.records)


def test_a_pass_with_every_completion_masked_still_has_a_graph(tmp_path):
    """As TRL's: zeros that backward runs through (a micro-batch of truncated completions under
    mask_truncated_completions must not stop training)."""
    trainer = make_trainer(tmp_path, tiny_causal_lm("llama"))
    input_ids, attention_mask, K = rows_with_groups()
    attention_mask[:, -K:] = 0
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, K,
                                                                     compute_entropy=True)
    assert torch.equal(logps, torch.zeros_like(logps)) and torch.equal(entropies, torch.zeros_like(entropies))
    (logps.sum() + entropies.sum()).backward()
    assert all(p.grad is None or not p.grad.any() for p in trainer.model.parameters())


def test_a_pass_over_rows_of_equal_content_reuses_the_layout_and_its_masks(tmp_path):
    """TRL's reference / old-policy / policy passes of one batch: one layout, one set of masks; other rows or
    options build their own."""
    trainer = make_trainer(tmp_path, tiny_causal_lm("llama"))
    input_ids, attention_mask, K = rows_with_groups()

    def run(ids, mask, batch_size=None):
        with torch.no_grad():
            out = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, K, batch_size)[0]
        return out, trainer.passes.last_layout.lines

    logps, lines = run(input_ids, attention_mask)
    assert len(lines.masks) == 1
    again, reused = run(input_ids.clone(), attention_mask.clone())  # new tensors, same content (as TRL's cat)
    assert reused is lines and len(lines.masks) == 1 and torch.equal(again, logps)
    full = int((attention_mask[:, -K:].sum(1) == K).nonzero()[0])
    shorter = attention_mask.clone()
    shorter[full, -1] = 0  # one completion a token shorter
    _, other = run(input_ids, shorter)
    assert other is not lines and other.num_real_tokens == lines.num_real_tokens - 1
    trainer.change_settings(packing=False)
    _, unpacked = run(input_ids, shorter)
    assert unpacked is not other and unpacked.num_lines == 3 and len(unpacked.masks) == 1
    _, chunked = run(input_ids, shorter, batch_size=1)  # the same lines, one per forward
    assert chunked is unpacked and len(unpacked.masks) == 1 + 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segmented_attention_on_group_lines_equals_the_dense_mask(dtype):
    """The segmented plan a GRPO pass runs on its lines (`GROUP_SEGMENT_WASTE` padding, causal groups without a mask, the others
    with their kept additive mask) against dense-mask SDPA on the same lines: outputs within K_FORWARD eps of the
    values' largest |entry| (an output is a convex combination of them), q/k/v gradients within K eps of their
    largest entry (`tolerances`), with several padded non-causal groups in the plan (so mask and padding are
    exercised); and in float64. ~1 s."""
    from prefixdpo.core.attention.masks import dense_mask
    from prefixdpo.core.attention.segments import segmented_attention
    from prefixdpo.grpo.logps import _chunk_plan

    gen = torch.Generator().manual_seed(0)
    prompt_lengths = (5, 19, 11)  # three prompts, G = 6 completions of spread lengths each
    prompt_tokens = torch.randint(3, 100, (3, 19), generator=gen)
    rows = [(group, int(n)) for group in range(3) for n in torch.randint(1, 40, (6,), generator=gen)]
    ids = torch.randint(3, 100, (len(rows), 19 + 40), generator=gen)
    mask = torch.zeros_like(ids)
    for r, (group, n) in enumerate(rows):
        ids[r, :19] = prompt_tokens[group]
        mask[r, 19 - prompt_lengths[group]:19 + n] = 1
    lines = layout_groups(ids, mask, 40, packing=True, pack_length=10**6)
    plan = _chunk_plan(lines, 0, lines.num_lines, "segmented").mask  # the plan a GRPO pass runs
    padded = [g for g in plan.groups if not g.causal and min(g.key_counts) < g.num_keys]
    assert len(padded) >= 2 and any(g.causal and g.num_segments > 1 for g in plan.groups)

    B, L = lines.input_ids.shape
    H, Hkv, D = 4, 2, 8
    q = torch.randn(B, H, L, D, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, L, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, L, D, generator=gen).to(dtype).requires_grad_()
    weights = torch.randn(B, L, H, D, generator=gen).to(dtype)
    real = (lines.spans[..., 0] >= 0)[:, :, None, None]
    ours = segmented_attention(q, k, v, plan)
    ours_grads = torch.autograd.grad((ours * weights * real).sum(), (q, k, v))
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(lines.spans), enable_gqa=True).transpose(1, 2)
    dense_grads = torch.autograd.grad((dense * weights * real).sum(), (q, k, v))
    assert_within(ours * real, dense * real, v.abs().max().item(), dtype, K_FORWARD, "outputs")
    for name, a, b in zip("qkv", ours_grads, dense_grads):
        assert_within(a, b, b.abs().max().item(), dtype, what=f"{name} gradient")
