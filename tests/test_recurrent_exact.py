"""Hybrid models (recurrent, convolution or state-space layers beside attention) on prefix-shared lines, exact.

With `core.recurrent.prepare_recurrent(model)` and `model(..., pass_plan=plan)`, every recurrent mixer runs each run of
a line from its parent run's final state (`core.recurrent`). Against STOCK separate passes (each `[prompt][response]`
alone, the stock model: `core.verify.separate_pass_logps`), every response's log-prob sum is within K_FORWARD eps x
the largest |sum| and every parameter's gradient of a DPO-shaped loss within K eps x the largest entry
(`tolerances`), fp32, tiny models of each family (`prefixdpo_tools.hybrid_models`), on a paired line, a line of
K = 4 responses, two examples packed in a padded line, and a trie across records (a system prompt, then two prompts,
one of a single token, then responses, one of a single token).

Granite 4 hybrid (granitemoehybrid) runs in float64 (`tolerances.float64_model`, eager experts: the grouped matmul
has no float64), within the same bounds in float32 eps: its Mamba2's own float32 casts (`A_log.float()`, `dt.float()`)
leave float32 rounding there (measured 1.5 eps x scale at most). In float32 it is exact in its math too (float64 with
every float32 cast lifted: sums 2e-14 apart, gradients 1.2e-12 of 23.3), but its convolution weight's gradient
cancels: stock padded rows already differ from stock separate passes by ~100 eps x the largest entry, a shared line
by up to ~150, beyond the rule's K = 128. Zamba2 likewise: in float64 (its Mamba2's float32 casts kept) the shared
lines are within 0.8 eps32 x scale of separate passes; in float32 its gradients are ill-conditioned: stock separate
passes are already ~290 eps32 x the largest entry from the float64 gradients, a shared line ~290-360.
"""

from __future__ import annotations

import copy

import functools
import random
from dataclasses import dataclass

import pytest
import torch

from conftest import random_examples
from prefixdpo.core.attention.backends import ATTENTION_NAME
from prefixdpo.core.attention.pass_plan import plan_pass
from prefixdpo.core.model_checks import base_model
from prefixdpo.core.recurrent import SUPPORTED_MIXERS, prepare_recurrent, supported_mixers
from prefixdpo.core.verify import dpo_loss, gradients, separate_pass_logps, verify_batch
from prefixdpo.data.example import Example
from prefixdpo_tools.hybrid_models import tiny_hybrid_lm
from tolerances import K, K_FORWARD, assert_small, bound, float64_model

FAMILIES = ["qwen3_5_text", "lfm2", "nemotron_h", "kimi_linear", "qwen3_next", "qwen3_5_moe_text", "lfm2_moe",
            "lfm3", "bamba", "falcon_h1", "mamba2"]


@dataclass(frozen=True)
class LinePlan:
    """The pass plan's contract with `core.recurrent`: spans [B, L, 2] long, (tin, tout) per column."""

    spans: torch.Tensor


def trie_examples() -> list[Example]:
    """A system prompt, then two prompts (one a single token), then their responses (one a single token)."""
    g = random.Random(0)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(g.randrange(3, 96) for _ in range(n))

    system = ids(6)
    return [Example(system + ids(4), (ids(3), ids(5)), ((0, 1),)),
            Example(system + ids(1), (ids(4), ids(2), ids(1)), ((0, 1), (0, 2)))]


def layouts() -> dict[str, tuple[list[Example], dict]]:
    paired, k4, other = random_examples()
    return {"paired": ([paired], {}), "k4": ([k4], {}),
            "packed": ([paired, other], dict(packs=[[0, 1]], pad_multiple=8)),
            "trie": (trie_examples(), dict(tree=True, pad_multiple=8))}


FLOAT64_FAMILIES = ["granitemoehybrid", "zamba2"]  # module docstring


@functools.lru_cache(maxsize=None)
def hybrid(family: str):
    model = tiny_hybrid_lm(family)
    if family in FLOAT64_FAMILIES:
        model.set_experts_implementation("eager")
        model = float64_model(model)
    assert prepare_recurrent(model), f"{family}: no recurrent mixer wrapped"
    return model


def response_sums(logits: torch.Tensor, batch) -> torch.Tensor:
    """Per-response log-prob sums [R] from a pass's logits [B, L, V] over the batch's lines."""
    token_logps = logits[batch.target_line, batch.target_col].log_softmax(-1)
    token_logps = token_logps.gather(1, batch.target_ids[:, None])[:, 0]
    return token_logps.new_zeros(batch.num_responses).index_add(0, batch.target_response, token_logps)


def line_pass(model, batch, plan: bool = True, backend: str = "sdpa") -> torch.Tensor:
    """Logits [B, L, V] of one pass over the batch's lines: prefixdpo's attention on `backend` with the lines' rule,
    the recurrent mixers with the lines' spans (plan=False: without them, the stock mixers straight along each line)."""
    base_model(model).set_attn_implementation(ATTENTION_NAME)
    pass_plan = plan_pass(batch, backend)
    extra = {"pass_plan": pass_plan} if plan else {}
    return model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                 attention_mask=pass_plan.model_mask(), **extra).logits


def differences(model, examples, backend: str = "sdpa", **layout):
    """(max |ours - separate| of the sums, largest |sum|, max gradient difference, largest gradient entry)."""
    batch = verify_batch(examples, **layout)
    model.zero_grad(set_to_none=True)
    separate = separate_pass_logps(model, examples)
    ours = response_sums(line_pass(model, batch, backend=backend), batch)
    grads = []
    for sums in (separate, ours):
        dpo_loss(sums, batch.pair_better, batch.pair_worse).backward()
        grads.append(gradients(model).clone())
        model.zero_grad(set_to_none=True)
    return ((ours - separate).abs().max().item(), separate.abs().max().item(),
            (grads[1] - grads[0]).abs().max().item(), grads[0].abs().max().item())


@pytest.mark.parametrize("layout", ["paired", "k4", "packed", "trie"])
@pytest.mark.parametrize("family", FAMILIES + FLOAT64_FAMILIES)
def test_shared_lines_match_stock_separate_passes(family, layout):
    examples, options = layouts()[layout]
    logp_diff, logp_scale, grad_diff, grad_scale = differences(hybrid(family), examples, **options)
    assert_small(logp_diff, logp_scale, k=K_FORWARD, what=f"{family} {layout} sums")
    assert_small(grad_diff, grad_scale, k=K, what=f"{family} {layout} gradients")


def test_without_the_plan_a_recurrent_layer_carries_one_response_into_the_next():
    """The check sees the leak the wrappers close: the same line without `pass_plan` runs the stock mixers straight
    through it (the convolution window and state of r1 into r2), far outside the rule."""
    model = hybrid("lfm2")
    examples, options = layouts()["paired"]
    batch = verify_batch(examples, **options)
    separate = separate_pass_logps(model, examples)
    sums = response_sums(line_pass(model, batch, plan=False), batch)
    scale = separate.abs().max().item()
    # the first response sees only the prompt before it: within the rule; the second reads r1's state: far outside
    assert_small(abs(sums[0] - separate[0]).item(), scale, k=K_FORWARD, what="first response")
    assert abs(sums[1] - separate[1]).item() > 1000 * bound(scale, k=K_FORWARD)


def test_every_family_has_its_mixers_wrapped_and_only_those():
    model = hybrid("qwen3_5_text")
    assert supported_mixers(model) == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    wrapped = [m.forward for m in model.modules() if getattr(m, "_prefixdpo_recurrent", False)]
    assert len(wrapped) == 2
    assert prepare_recurrent(model) == supported_mixers(model)  # idempotent: a second call wraps nothing again
    assert [m.forward for m in model.modules() if getattr(m, "_prefixdpo_recurrent", False)] == wrapped
    assert set(SUPPORTED_MIXERS.values()) == set(FAMILIES + FLOAT64_FAMILIES)


def test_a_copy_of_a_wrapped_model_runs_its_own_mixers():
    """A deepcopy of a prepared model (TRL's and prefixdpo's reference copies) runs its own weights, with and without
    a plan: the wrapper is bound to its mixer, not a closure over the original (which made a halved copy run the
    original's convolutions: 0.75 off in the logits)."""
    model = tiny_hybrid_lm("lfm2")
    fresh = copy.deepcopy(model)
    prepare_recurrent(model)
    wrapped = copy.deepcopy(model)
    with torch.no_grad():
        for a, b in zip(wrapped.parameters(), fresh.parameters()):
            a.mul_(0.5), b.mul_(0.5)
    ids = torch.randint(3, 90, (1, 10), generator=torch.Generator().manual_seed(0))
    spans = torch.stack([torch.arange(10), torch.full((10,), 10)], -1)[None]
    expected = fresh(input_ids=ids, use_cache=False).logits
    assert torch.equal(wrapped(input_ids=ids, use_cache=False).logits, expected)
    assert torch.equal(wrapped(input_ids=ids, use_cache=False, pass_plan=LinePlan(spans)).logits, expected)


def test_a_mixer_carries_state_and_gradient_exactly_in_float64():
    """One LFM2 short-convolution mixer alone, float64 (it casts nothing to float32): a trie of runs against stock
    calls on each root-to-leaf sequence; its outputs and its input's gradient (the prompt's summed over both
    responses, reaching it only through the carried convolution state) within K eps64."""
    from tolerances import EPS64

    model = tiny_hybrid_lm("lfm2", dtype=torch.float64)
    mixer = model.model.layers[0].conv
    prepare_recurrent(model)
    g = torch.Generator().manual_seed(0)
    p, a, b = 5, 3, 1  # a prompt, then a three-token and a one-token response
    x = torch.randn(1, p + a + b, 64, dtype=torch.float64, generator=g, requires_grad=True)
    columns = torch.arange(p + a + b)
    tout = torch.tensor([p + a + b] * p + [p + a] * a + [p + a + b] * b)
    y = mixer(x, pass_plan=LinePlan(torch.stack([columns, tout], -1)[None]))
    upstream = torch.randn(y.shape, dtype=torch.float64, generator=g)
    grad, = torch.autograd.grad((y * upstream).sum(), x)

    first, second = x[:, :p + a].detach().requires_grad_(), torch.cat([x[:, :p], x[:, p + a:]], 1).detach()
    second.requires_grad_()
    y1, y2 = mixer(first), mixer(second)
    g1, = torch.autograd.grad((y1 * upstream[:, :p + a]).sum(), first)
    g2, = torch.autograd.grad((y2[:, p:] * upstream[:, p + a:]).sum(), second)
    expected_y = torch.cat([y1, y2[:, p:]], 1)
    expected_grad = torch.cat([g1[:, :p] + g2[:, :p], g1[:, p:], g2[:, p:]], 1)
    assert (y - expected_y).abs().max().item() <= K * EPS64 * expected_y.abs().max().item()
    assert (grad - expected_grad).abs().max().item() <= K * EPS64 * expected_grad.abs().max().item()
    assert g2[:, :p].abs().max() > 0  # the second response's gradient does reach the prompt


def test_gradient_checkpointing_recomputes_the_same_runs():
    """A checkpointed decoder layer reruns its mixer in backward with the same `pass_plan`: the same gradients."""
    model = tiny_hybrid_lm("qwen3_5_text")
    prepare_recurrent(model)
    examples, options = layouts()["trie"]
    batch = verify_batch(examples, **options)
    mixer, calls = model.model.layers[0].linear_attn, []
    wrapped = mixer.forward
    mixer.forward = lambda *args, **kwargs: calls.append(kwargs.get("pass_plan")) or wrapped(*args, **kwargs)
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train(checkpointing)  # transformers checkpoints only in training mode (the tiny model has no dropout)
        sums = response_sums(line_pass(model, batch), batch)
        dpo_loss(sums, batch.pair_better, batch.pair_worse).backward()
        grads.append(gradients(model).clone())
        model.zero_grad(set_to_none=True)
    assert len(calls) == 3 and all(plan is not None for plan in calls)  # once, then twice: forward and recompute
    assert_small((grads[1] - grads[0]).abs().max().item(), grads[0].abs().max().item(), k=K, what="checkpointed")


def test_a_recurrent_layer_that_cannot_take_a_parents_state_is_refused_by_name():
    """RecurrentGemma keeps its states on the module (no cache to hand a parent's state through): one line, naming
    the layer type and why."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("recurrent_gemma", vocab_size=96, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  lru_width=32)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as refused:
        prepare_recurrent(model)
    message = str(refused.value)
    assert message.startswith("RecurrentGemmaRecurrentBlock cannot share prefixes exactly: keeps its convolution")
    assert "\n" not in message
    assert not any(getattr(m, "_prefixdpo_recurrent", False) for m in model.modules())  # nothing half-wrapped


def test_transformers_own_cache_writes_in_place_where_run_states_do_not():
    """Why `RunStates` and not transformers' DynamicCache: its linear-attention layers `copy_` a mixer's final state
    into the buffer the mixer read its initial state from, which Qwen3.5's chunked rule saved for backward."""
    from transformers import DynamicCache

    model = hybrid("qwen3_5_text")
    mixer = model.model.layers[0].linear_attn
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    cache = DynamicCache(config=model.config)
    through_cache = mixer(x[:, :5], cache=cache).sum() + mixer(x[:, 5:], cache=cache).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        through_cache.backward()
    # the same prompt with two responses through RunStates: each response from the prompt's state, and the
    # prompt's gradient (both responses' parts) equal to separate stock calls'
    p, a, b = 5, 2, 2
    tout = torch.tensor([p + a + b] * p + [p + a] * a + [p + a + b] * b)
    runs = LinePlan(torch.stack([torch.arange(p + a + b), tout], -1)[None])
    x.grad = None
    mixer(x, pass_plan=runs).sum().backward()
    first, second = x[:, :p + a].detach().requires_grad_(), torch.cat([x[:, :p], x[:, p + a:]], 1).detach()
    second.requires_grad_()
    (mixer(first).sum() + mixer(second)[:, p:].sum()).backward()
    expected = torch.cat([first.grad[:, :p] + second.grad[:, :p], first.grad[:, p:], second.grad[:, p:]], 1)
    assert_small((x.grad - expected).abs().max().item(), expected.abs().max().item(), k=K, what="input gradient")


def test_an_older_transformers_refuses_the_mixers_it_hands_states_otherwise(monkeypatch):
    """transformers 5.17's mixers read their states through another cache API (measured: 6e-3 off on LFM2, CPU and
    H200): there every supported mixer is refused by name, so prefix sharing says so in one line."""
    import transformers

    from prefixdpo.core.model_checks import refusal, unshareable_layers

    model = hybrid("lfm2")
    assert unshareable_layers(model) == []
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    assert unshareable_layers(model) == ["Lfm2ShortConv"]
    assert "--prefix_sharing false" in refusal(model, "sdpa")
