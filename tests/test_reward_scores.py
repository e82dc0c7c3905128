"""Reward scores from prefix-shared rows equal separate stock passes of the model (fp32, `assert_scores_match`;
one float64 case), on tiny
Llama, Qwen2, Qwen3 and Mistral sequence classifiers: K = 2 and 4, unpacked and packed, with padding
(lines of different lengths, padded to a multiple of 128), standard rows packed without sharing, and
the gradients of a Bradley-Terry loss; and on tree lines (`data.tree`: records sharing a prompt, a system prompt,
dialogues whose earlier turns are later prompts; two lines, padded). Also: where the score is read (the last token
that is not the pad token, as the stock model pools; on tree lines too), the loss, and refusals."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from conftest import TINY, random_examples
from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo.data.tree import build_tree_batch
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.reward.losses import pair_reward_losses
from prefixdpo.core.scores import compute_response_scores, score_positions
from prefixdpo.reward.verify import compare_scores
from prefixdpo.core.attention.pass_plan import plan_pass
from test_tree import CASES as TREE_CASES
from tolerances import assert_matches_separate_passes, assert_within, float64_model


def tiny_reward_model(arch: str = "llama", pad_token_id: int = 0, **overrides):
    """A tiny fp32 `AutoModelForSequenceClassification` (num_labels=1) of `arch`, seeded, in eval mode."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    kwargs = dict(TINY, num_labels=1, pad_token_id=pad_token_id)
    if arch in ("qwen2", "qwen3", "mistral", "llama"):
        kwargs["num_key_value_heads"] = 2  # GQA
    if arch == "qwen3":
        kwargs["head_dim"] = 8
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(arch, **kwargs), dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init, so a wrong layout shows clearly in the scores
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.train(False)


def score_scale(model) -> float:
    """The scale of a reward score's rounding: a score is the head's dot product w . h with the final RMS-normed
    hidden state h (|h|_2 <= sqrt(D) x the norm's largest weight), whose terms cancel, so it carries eps x
    |w|_2 |h|_2, not eps x |score|."""
    head, norm = model.score.weight, model.base_model.norm.weight
    return head.norm().item() * norm.numel() ** 0.5 * norm.abs().max().item()


def assert_scores_match(result, model, dtype: torch.dtype = torch.float32) -> None:
    """`compare_scores`' result within the rule of `tolerances`: scores within K_FORWARD eps of `score_scale`,
    gradients within K eps of their largest entry."""
    assert_matches_separate_passes(dataclasses.replace(result, logp_scale=score_scale(model)), dtype)


# (prompt length, response lengths): K = 2, K = 4 (best vs each), K = 2 with a one-token response
SHAPES = ((7, (5, 3)), (4, (6, 2, 3, 4)), (9, (1, 8)))
LAYOUTS = {  # name: (packs, prefix_sharing, pad_multiple)
    "shared, unpacked, padded": (None, True, 128),
    "shared, one packed line": ([[0, 1, 2]], True, 1),
    "shared, two packed lines, padded": ([[0, 2], [1]], True, 128),
    "standard rows packed, no sharing": ([[0, 1], [2]], False, 1),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_scores_and_gradients_equal_separate_stock_passes(arch):
    model = tiny_reward_model(arch)
    examples = random_examples(seed=1, shapes=SHAPES)  # tokens 3..95: the pad token (0) occurs only as padding
    for name, (packs, sharing, multiple) in LAYOUTS.items():
        result = compare_scores(model, examples, packs=packs, prefix_sharing=sharing, pad_multiple=multiple, case=name)
        assert result.logp_scale > 0.1 and result.grad_scale > 1e-3  # the comparison means something
        assert_scores_match(result, model)


def test_scores_and_gradients_equal_separate_stock_passes_in_float64():
    """float64 (`tolerances.float64_model`; scores and the loss stay float32, as prefixdpo computes them: equal
    float64 scores round to equal float32 ones), packed lines with padding: agreement to float64 rounding."""
    model = float64_model(tiny_reward_model("llama"))
    packs, sharing, multiple = LAYOUTS["shared, two packed lines, padded"]
    result = compare_scores(model, random_examples(seed=1, shapes=SHAPES), packs=packs, prefix_sharing=sharing,
                            pad_multiple=multiple, case="float64")
    assert_scores_match(result, model, torch.float64)


def test_the_score_is_read_where_the_stock_model_pools():
    """Responses ending in (or made only of) the pad token: TRL's pad is often the EOS ending every response,
    and the stock model reads the last token that is not the pad token, in the prompt if need be."""
    pad = 5
    model = tiny_reward_model("qwen2", pad_token_id=pad)
    examples = [Example([9, 10, 11], [[12, 13, pad], [pad]], pairs=[(0, 1)]),
                Example([pad, 20, pad], [[pad, pad], [21, pad, 22]], pairs=[(1, 0)]),
                Example([pad], [[pad], [30]], pairs=[(1, 0)])]
    batch = build_batch(examples, prefix_sharing=True, packs=[[0, 1, 2]], pad_token_id=pad)
    line, column = score_positions(batch, pad)
    # the line: [9 10 11 | 12 13 5 | 5 ][5 20 5 | 5 5 | 21 5 22][5 | 5 | 30]
    assert line.tolist() == [0] * 6
    assert column.tolist() == [4, 2, 8, 14, 15, 17]
    for packs in (None, [[0, 1, 2]]):
        result = compare_scores(model, examples, packs=packs, pad_token_id=pad)
        assert_scores_match(result, model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(TREE_CASES))
def test_scores_on_tree_lines_equal_separate_stock_passes(arch, case):
    """depth-1: prompts named by three records each (a response in two records); depth-2: a system prompt in front
    of every prompt, one prompt named by two records; depth-3: dialogues, each turn's `[prompt][chosen]` a prefix
    of the next turn's prompt (a sequence that ends inside the tree). Two lines, the shorter padded."""
    build, _, lines = TREE_CASES[case]
    examples = build(random.Random(len(arch)))
    model = tiny_reward_model(arch)
    result = compare_scores(model, examples, packs=lines, pad_multiple=8, tree=True)
    assert result.logp_scale > 0.1 and result.grad_scale > 1e-3
    assert_scores_match(result, model)


def test_the_score_is_read_where_the_stock_model_pools_on_tree_lines():
    """A tree line with the pad token inside sequences: each score is read at the last non-pad token of its own
    sequence (an inner node where the sequence is a prefix of another), at its first token if all are pad."""
    pad = 5
    examples = [Example([9, 10, 11], [[12, 13, pad], [pad]], pairs=[(0, 1)]),
                Example([9, 10, 11, 12, 13], [[pad, 7], [14]], pairs=[(1, 0)]),
                Example([pad], [[pad], [30]], pairs=[(1, 0)])]
    batch = build_tree_batch(examples, pad_multiple=16, pad_token_id=pad)
    # the line: 9 10 11 12 13 5 7 14 5 | 5 5 30 | padding (5); [9 10 11 12 13 5] ends at the inner node 5 (row 5)
    assert batch.input_ids[0, :12].tolist() == [9, 10, 11, 12, 13, pad, 7, 14, pad, pad, pad, 30]
    assert batch.response_last.tolist() == [5, 8, 6, 7, 10, 11]
    line, column = score_positions(batch, pad)
    assert line.tolist() == [0] * 6 and column.tolist() == [4, 2, 6, 7, 9, 11]
    assert score_positions(batch, None)[1].tolist() == [5, 8, 6, 7, 10, 11]  # no pad token: the last token
    model = tiny_reward_model("qwen2", pad_token_id=pad)
    result = compare_scores(model, examples, pad_token_id=pad, tree=True, pad_multiple=16)
    assert_scores_match(result, model)


def test_empty_micro_batch_joins_the_backward_with_zero_weight():
    from prefixdpo.data.loader import empty_batch

    model = tiny_reward_model("llama")
    prepare_model(model, "sdpa")
    batch = empty_batch()
    scores = compute_response_scores(model, batch, plan_pass(batch, "sdpa"))
    scores.sum().backward()
    assert scores.tolist() == [0.0]
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_bradley_terry_loss_with_margin_and_centering():
    scores = torch.tensor([1.0, -0.5, 2.0, 0.25])
    better, worse = torch.tensor([0, 2, 2]), torch.tensor([1, 1, 3])
    margins = torch.tensor([0.5, 0.0, 1.0])
    losses = pair_reward_losses(scores, better, worse, margins, center_coefficient=0.01)
    gap = torch.tensor([1.5 - 0.5, 2.5, 1.75 - 1.0])
    center = 0.01 * torch.tensor([0.5, 1.5, 2.25]) ** 2
    # the same few operations on exact inputs: within one rounding of the gaps' inputs (the scores, x 2)
    scale = 2 * scores.abs().max().item()
    assert_within(losses, torch.nn.functional.softplus(-gap) + center, scale, k=1, what="centered losses")
    plain = pair_reward_losses(scores, better, worse)
    assert_within(plain, torch.nn.functional.softplus(-torch.tensor([1.5, 2.5, 1.75])), scale, k=1, what="losses")


def test_models_that_are_not_one_label_classifiers_are_refused():
    from conftest import tiny_model

    batch = build_batch(random_examples())
    mask = plan_pass(batch, "sdpa")  # the sdpa backend's plan
    causal = tiny_model("llama")
    prepare_model(causal, "sdpa")
    with pytest.raises(UnsupportedModelError, match="no `score` head"):
        compute_response_scores(causal, batch, mask)
    two = tiny_reward_model("llama", num_labels=2)
    prepare_model(two, "sdpa")
    with pytest.raises(UnsupportedModelError, match="num_labels=2"):
        compute_response_scores(two, batch, mask)
    unpadded = tiny_reward_model("llama", pad_token_id=None)
    prepare_model(unpadded, "sdpa")
    with pytest.raises(UnsupportedModelError, match="pad_token_id"):
        compute_response_scores(unpadded, batch, mask)
