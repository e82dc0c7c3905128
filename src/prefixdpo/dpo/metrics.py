"""DPO's training/eval metrics under TRL's names (`rewards/*`, `logps/*`), summed per pair (`training.metrics`)."""

from __future__ import annotations

import torch

from prefixdpo.dpo.losses import rewards
from prefixdpo.training.metrics import COUNTS, MetricSums

# per-pair sums -> logged as sum / pairs, under TRL's names
PAIR_METRICS = (
    "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected",
)


def pair_metric_sums(policy_c, policy_r, ref_c, ref_r, len_c, len_r, beta: float) -> dict[str, float]:
    """Sums over the pairs of one micro-batch (all inputs [P]; ref_* None for reference-free losses).

    One `.tolist()` for all six sums: each `.item()` would be a device sync on GPU, every micro-batch.
    """
    r_c = rewards(policy_c, ref_c, beta, len_c).detach()
    r_r = rewards(policy_r, ref_r, beta, len_r).detach()
    sums = torch.stack([
        r_c.sum(), r_r.sum(), (r_c - r_r).sum(), (r_c > r_r).to(r_c.dtype).sum(),
        policy_c.detach().sum(), policy_r.detach().sum(),
    ]).tolist()
    return dict(zip(PAIR_METRICS, sums))


class DPOMetricSums(MetricSums):
    """DPO's per-pair sums between two logs, logged as means per pair."""

    KEYS = PAIR_METRICS + COUNTS

    def means(self, totals: dict[str, float], accelerator=None) -> dict[str, float]:
        pairs = max(totals["pairs"], 1.0)
        return {k: totals[k] / pairs for k in PAIR_METRICS}
