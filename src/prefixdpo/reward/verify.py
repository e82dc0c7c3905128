"""Check prefix-shared reward scores against separate stock passes on a user's own reward model.

The reference is independent of prefixdpo's forward: each `[prompt][response]` runs alone through the
model's own `forward` with its stock attention, and the score is what the model itself pools (the last
non-pad token). Gradients are those of a Bradley-Terry loss over the examples' pairs, from either side.
"""

from __future__ import annotations

import torch

from prefixdpo.data.example import Example
from prefixdpo.core.model_checks import text_config
from prefixdpo.reward.losses import pair_reward_losses
from prefixdpo.core.scores import compute_response_scores
from prefixdpo.core.verify import VerifyResult, compare_passes, stock_sequences


def separate_pass_scores(model, examples: list[Example]) -> torch.Tensor:
    """Scores [R] (responses in example order), one stock forward per `[prompt][response]` sequence."""
    return torch.stack([model(input_ids=ids, use_cache=False).logits[0, 0].float()
                        for _, ids in stock_sequences(model, examples)])


def compare_scores(model, examples: list[Example], *, packs=None, backend: str = "sdpa", prefix_sharing: bool = True,
                   pad_multiple: int = 1, case: str = "", pad_token_id: int = 0,
                   restart_positions: bool = True, tree: bool = False) -> VerifyResult:
    """Max abs diff of per-response scores and of Bradley-Terry-loss gradients, our layout vs separate passes
    (`core.verify.compare_passes`).

    packs / prefix_sharing / pad_multiple / tree: the layout, as `prefixdpo.core.verify.compare` (padding tokens are
    `pad_token_id`). `VerifyResult.logp_*` hold the score differences. restart_positions=False breaks the layout on
    purpose (positions run on through the row), to show the check catches a wrong setup.
    """
    return compare_passes(
        model, examples, separate_pass_scores, compute_response_scores,
        lambda scores, batch: pair_reward_losses(scores, batch.pair_better, batch.pair_worse).mean(),
        backend=backend, case=case, packs=packs, prefix_sharing=prefix_sharing, tree=tree, pad_multiple=pad_multiple,
        pad_token_id=pad_token_id, restart_positions=restart_positions)


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
