"""PNG chart of a benchmark: grouped bars per profile, throughput of each mode relative to `paired`."""

from __future__ import annotations

from pathlib import Path

from prefixdpo.atomic_io import atomic_path
from prefixdpo_tools.bench.runner import ProfileResult

__all__ = ["MODE_COLOURS", "plot_results"]

MODE_COLOURS = {"paired": "#9e9e9e", "paired-packed": "#5c6bc0", "shared": "#ffb74d", "shared-packed": "#e64a19",
                "grouped-packed": "#8e24aa", "trie-packed": "#00897b"}


def plot_results(results: list[ProfileResult], path: str | Path, title: str = "prefixdpo bench") -> Path:
    """Bars: median pairs/s of each mode / median pairs/s of `paired` (min-max as error bars).
    Markers: the paper's packed speedup and our ideal, both relative to paired-packed's bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    modes = list(dict.fromkeys(m for r in results for m in r.modes))  # grouped-packed: only where it ran
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(results) + 2), 4.2))
    for k, mode in enumerate(modes):
        xs, ys, lo, hi = [], [], [], []
        for i, r in enumerate(results):
            if mode not in r.modes:
                continue
            base = r.modes["paired"].pairs_per_s.median if "paired" in r.modes else 1.0
            s = r.modes[mode].pairs_per_s
            xs.append(i + (k - (len(modes) - 1) / 2) * width)
            ys.append(s.median / base)
            lo.append((s.median - s.min) / base)
            hi.append((s.max - s.median) / base)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=mode, color=MODE_COLOURS.get(mode))
    for i, r in enumerate(results):
        if "paired-packed" not in r.modes or "paired" not in r.modes:
            continue
        pp = r.modes["paired-packed"].pairs_per_s.median / r.modes["paired"].pairs_per_s.median
        x = i + (len(modes) - 1) / 2 * width
        ax.plot([x - width / 2, x + width / 2], [pp * r.ideal] * 2, color="black", lw=2,
                label="ideal (x paired-packed)" if i == 0 else None)
        if r.paper is not None:
            ax.plot(x, pp * r.paper["shared_packed_vs_paired_packed"], "k^", ms=6,
                    label="paper packed speedup (x paired-packed)" if i == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(results)), [r.name for r in results], rotation=15)
    ax.set_ylabel("pairs/s relative to paired")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with atomic_path(str(path)) as tmp:  # the format from the real name: the temporary one has no image suffix
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path
