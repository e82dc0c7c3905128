"""Check prefix-shared reward scores against separate stock passes on a user's own reward model.

The reference is independent of prefixdpo's forward: each `[prompt][response]` runs alone through the
model's own `forward` with its stock attention, and the score is what the model itself pools (the last
non-pad token). Gradients are those of a Bradley-Terry loss over the examples' pairs, from either side.
"""

from __future__ import annotations

import torch

from prefixdpo.core.attention.backends import batch_attention_mask, resolve_backend
from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example
from prefixdpo.data.tree import build_tree_batch
from prefixdpo.core.model_checks import prepare_model, text_config
from prefixdpo.reward.losses import pair_reward_losses
from prefixdpo.core.scores import compute_response_scores
from prefixdpo.core.verify import VerifyResult, stock_sequences


def separate_pass_scores(model, examples: list[Example]) -> torch.Tensor:
    """Scores [R] (responses in example order), one stock forward per `[prompt][response]` sequence."""
    return torch.stack([model(input_ids=ids, use_cache=False).logits[0, 0].float()
                        for _, ids in stock_sequences(model, examples)])


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def compare_scores(model, examples: list[Example], *, packs=None, backend: str = "sdpa", prefix_sharing: bool = True,
                   pad_multiple: int = 1, case: str = "", pad_token_id: int = 0,
                   restart_positions: bool = True, tree: bool = False) -> VerifyResult:
    """Max abs diff of per-response scores and of Bradley-Terry-loss gradients, our layout vs separate passes.

    packs / prefix_sharing / pad_multiple / tree: the layout, as `prefixdpo.core.verify.compare` (padding tokens are
    `pad_token_id`). Gradients are compared where the backend has a backward on the model's device.
    `VerifyResult.logp_*` hold the score differences. restart_positions=False breaks the layout on purpose
    (positions run on through the row), to show the check catches a wrong setup.
    """
    device = next(model.parameters()).device
    if tree:
        batch = build_tree_batch(examples, packs, pad_multiple=pad_multiple, pad_token_id=pad_token_id)
    else:
        batch = build_batch(examples, prefix_sharing=prefix_sharing, packs=packs, pad_multiple=pad_multiple,
                            pad_token_id=pad_token_id)
    if not restart_positions:
        batch.position_ids = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids).clone()
    batch = batch.to(device)
    with_grad = not (backend == "flex" and device.type == "cpu")
    backend = resolve_backend(backend, device, needs_grad=with_grad)
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(with_grad):
        reference = separate_pass_scores(model, examples)
        prepare_model(model, backend)
        mask = batch_attention_mask(batch, backend)
        ours = compute_response_scores(model, batch, mask)
    result = VerifyResult(case=case, logp_diff=(ours - reference).detach().abs().max().item(),
                          logp_scale=reference.detach().abs().max().item(), grad_diff=None, grad_scale=None)
    if with_grad:
        grads = []
        for scores in (reference, ours):
            pair_reward_losses(scores, batch.pair_better, batch.pair_worse).mean().backward()
            grads.append(_grads(model).clone())
            model.zero_grad(set_to_none=True)
        result.grad_diff = (grads[1] - grads[0]).abs().max().item()
        result.grad_scale = grads[0].abs().max().item()
    return result


def load_for_verify(name, tokenizer, *, dtype, device: str, trust_remote_code: bool = False):
    """(reward model on `device`, in eval mode, pad token id): `name` loaded as a one-label sequence classifier
    (a causal LM gets a new, seeded score head), its pad token the tokenizer's pad, else EOS (TRL's rule)."""
    from prefixdpo.errors import UserError
    from prefixdpo.reward.model import load_reward_model

    model = load_reward_model(name, dtype=dtype, trust_remote_code=trust_remote_code, seed=0).to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise UserError(f"the tokenizer of {name} has neither a pad nor an EOS token: the score position is undefined")
    cfg = text_config(model)
    cfg.pad_token_id = pad
    return model.train(False), pad
