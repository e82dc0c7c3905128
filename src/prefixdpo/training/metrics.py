"""Training/eval metric sums, reduced across ranks when logged (each method names its own metrics).

Every metric is kept as a running *sum* plus counts, and turned into a mean only when logged, after
one all-reduce of the sums: so metrics are pair-weighted over the logging interval and over all
ranks, whatever the micro-batch sizes were (a mean of per-batch means would not be).
"""

from __future__ import annotations

import time

import torch


# what every trainer counts per micro-batch (throughput, tokens saved, packing), beside its own metric sums
COUNTS = ("pairs", "real_tokens", "slots", "shared_tokens", "unshared_tokens", "loss_sum")


class MetricSums:
    """Running sums of the metrics of one split ('train' or 'eval') between two logs. A method's subclass
    names its sums in `KEYS` (with `COUNTS`) and turns the reduced sums into its logged metrics (`means`)."""

    KEYS: tuple[str, ...] = COUNTS
    counted = True  # False: this rank's sums are another's copy (a sequence-parallel group's), reduced as zeros

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
        t = torch.tensor([self.values[k] if self.counted else 0.0 for k in self.KEYS], dtype=torch.float64)
        if accelerator is not None and accelerator.num_processes > 1:
            t = accelerator.reduce(t.to(accelerator.device), reduction="sum").cpu()
        return dict(zip(self.KEYS, t.tolist()))

    def means(self, totals: dict[str, float], accelerator=None) -> dict[str, float]:
        """The method's own metrics from the reduced sums (every rank calls this)."""
        return {}

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
