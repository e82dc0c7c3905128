"""The Bradley-Terry reward-model loss and its metrics (TRL 1.16 `RewardTrainer`'s, per pair).

TRL's loss on a batch of P pairs (https://huggingface.co/papers/2203.02155, Eq. 1; centering:
https://huggingface.co/papers/2312.09244, Eq. 2) is

    mean_p -logsigmoid(r_chosen - r_rejected - margin)  +  c * mean_p (r_chosen + r_rejected)^2

which is the mean over pairs of the per-pair loss below: the trainer averages per-pair losses over the
optimizer step's pairs, whatever packing, accumulation or world size split them into.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixdpo.training.metrics import MetricSums


def pair_reward_losses(scores: torch.Tensor, better: torch.Tensor, worse: torch.Tensor,
                       margins: torch.Tensor | None = None, center_coefficient: float | None = None) -> torch.Tensor:
    """Per-pair losses [P] (fp32).

    scores: [R] reward of every response; better, worse: [P] response indices of each pair;
    margins: [P] TRL's `margin` column (None = 0); center_coefficient: TRL's `center_rewards_coefficient`.
    """
    chosen, rejected = scores[better].float(), scores[worse].float()
    gap = chosen - rejected
    if margins is not None:
        gap = gap - margins.to(gap)
    losses = -F.logsigmoid(gap)
    if center_coefficient is not None:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def pair_metric_values(scores: torch.Tensor, better: torch.Tensor, worse: torch.Tensor) -> dict[str, float]:
    """Sums, minimum and maximum over one micro-batch's pairs (one `.tolist()`: one device sync).

    Rewards are those of the pairs' sides, as TRL's padded rows hold them (a response in two pairs counts
    twice), so `mean_reward` is TRL's mean over its chosen and rejected rows.
    """
    chosen, rejected = scores[better].detach().float(), scores[worse].detach().float()
    sides = torch.cat([chosen, rejected])
    values = torch.stack([
        (chosen > rejected).float().sum(), (chosen - rejected).sum(), sides.sum(), sides.min(), sides.max(),
    ]).tolist()
    return dict(zip(("accuracy", "margin", "reward_sum", "min_reward", "max_reward"), values))


class RewardMetricSums(MetricSums):
    """Running sums of one split's reward metrics between two logs, reduced over ranks when logged.

    Logged under TRL's names: `accuracy` and `margin` (per pair), `mean_reward` (per pair side),
    `min_reward` / `max_reward` (over every side of the interval, on all ranks), plus the throughput and
    token-efficiency metrics of the DPO trainer.
    """

    KEYS = ("accuracy", "margin", "reward_sum", "pairs", "real_tokens", "slots", "shared_tokens",
            "unshared_tokens", "loss_sum")

    def reset(self) -> None:
        super().reset()
        self.low, self.high = float("inf"), float("-inf")

    def add(self, values: dict[str, float]) -> None:
        values = dict(values)
        self.low = min(self.low, values.pop("min_reward", self.low))
        self.high = max(self.high, values.pop("max_reward", self.high))
        super().add(values)

    def _extremes(self, accelerator) -> tuple[float, float]:
        local = torch.tensor([self.low, -self.high], dtype=torch.float64)
        if accelerator is not None and accelerator.num_processes > 1:  # a collective: every rank calls it
            local = accelerator.gather(local.to(accelerator.device)).cpu().view(-1, 2).amin(dim=0)
        return float(local[0]), -float(local[1])

    def means(self, totals: dict[str, float], accelerator=None) -> dict[str, float]:
        """TRL's reward metrics from the reduced sums, and the interval's extremes over all ranks."""
        low, high = self._extremes(accelerator)
        pairs = max(totals["pairs"], 1.0)
        out = {"accuracy": totals["accuracy"] / pairs, "margin": totals["margin"] / pairs,
               "mean_reward": totals["reward_sum"] / (2 * pairs)}
        if totals["pairs"] > 0:  # min/max of no reward at all would be +-inf
            out.update(min_reward=low, max_reward=high)
        return out
