"""Training/eval metrics with TRL's names, summed per pair and reduced across ranks.

Every metric is kept as a running *sum* plus counts, and turned into a mean only when logged, after
one all-reduce of the sums: so metrics are pair-weighted over the logging interval and over all
ranks, whatever the micro-batch sizes were (a mean of per-batch means would not be).
"""

from __future__ import annotations

import time

import torch

from prefixdpo.losses import rewards

# per-pair sums -> logged as sum / pairs, under TRL's names
PAIR_METRICS = (
    "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected",
)
COUNTS = ("pairs", "real_tokens", "slots", "shared_tokens", "unshared_tokens", "loss_sum")


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
    keys = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
            "logps/chosen", "logps/rejected")
    return dict(zip(keys, sums))


class MetricSums:
    """Running sums of the metrics of one split ('train' or 'eval') between two logs."""

    KEYS = PAIR_METRICS + COUNTS

    def __init__(self) -> None:
        self.last_pairs = 0.0  # pairs (all ranks) of the last summary
        self.reset()

    def reset(self) -> None:
        self.values = dict.fromkeys(self.KEYS, 0.0)
        self.started = time.perf_counter()

    def add(self, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.values[k] += float(v)

    def reduced(self, accelerator=None) -> dict[str, float]:
        """The sums over all ranks (one all-reduce; a collective: call it on every rank)."""
        t = torch.tensor([self.values[k] for k in self.KEYS], dtype=torch.float64)
        if accelerator is not None and accelerator.num_processes > 1:
            t = accelerator.reduce(t.to(accelerator.device), reduction="sum").cpu()
        return dict(zip(self.KEYS, t.tolist()))

    def means(self, totals: dict[str, float], accelerator=None) -> dict[str, float]:
        """The split's own metrics from the reduced sums (a subclass logs others; every rank calls this)."""
        pairs = max(totals["pairs"], 1.0)
        return {k: totals[k] / pairs for k in PAIR_METRICS}

    def summary(self, accelerator=None, prefix: str = "", with_loss: bool = False) -> dict[str, float]:
        """Means under TRL's names plus throughput and token-efficiency metrics; resets the sums."""
        s = self.reduced(accelerator)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.last_pairs = s["pairs"]
        out = self.means(s, accelerator)
        if with_loss:
            out["loss"] = s["loss_sum"] / max(s["pairs"], 1.0)
        out["pairs_per_second"] = s["pairs"] / elapsed
        out["tokens_per_second"] = s["real_tokens"] / elapsed
        # tokens standard paired DPO would run that prefix sharing did not (fraction of the standard)
        out["prefix_sharing/tokens_saved"] = 1.0 - s["shared_tokens"] / s["unshared_tokens"] if s["unshared_tokens"] else 0.0
        out["packing/efficiency"] = s["real_tokens"] / s["slots"] if s["slots"] else 0.0
        self.reset()
        return {f"{prefix}{k}": v for k, v in out.items()}
