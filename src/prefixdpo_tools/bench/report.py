"""Benchmark results as a markdown report (the paper's numbers beside ours) and as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict

from prefixdpo_tools.bench.runner import ProfileResult

__all__ = ["to_json", "markdown_report", "aims"]


def aims(r: ProfileResult) -> dict[str, bool]:
    """The issue's aims on one profile: shared ahead of paired; shared-packed at least as far ahead
    of paired-packed as the paper's packed table; achieved/ideal >= 0.9."""
    out = {"shared_beats_paired": r.speedups["shared_vs_paired"].median > 1.0,
           "achieved_over_ideal_ge_0.9": r.achieved_over_ideal >= 0.9}
    if r.grouped:
        out["grouped_over_ideal_ge_0.9"] = r.grouped_over_ideal()["vs_paired_packed"] >= 0.9
    if r.paper is not None:
        out["packed_ge_paper"] = (
            r.speedups["shared_packed_vs_paired_packed"].median >= r.paper["shared_packed_vs_paired_packed"])
    return out


def to_json(results: list[ProfileResult], meta: dict) -> str:
    """Everything measured, plus `meta` (machine, model, settings), as indented JSON."""
    payload = {"meta": meta, "profiles": []}
    for r in results:
        d = asdict(r)
        d["achieved_over_ideal"] = r.achieved_over_ideal
        d["grouped_over_ideal"] = r.grouped_over_ideal()
        d["trie_over_ideal"] = r.trie_over_ideal()
        d["aims"] = aims(r)
        for m, mr in r.modes.items():
            d["modes"][m] |= mr.derived()
        payload["profiles"].append(d)
    return json.dumps(payload, indent=2)


def _spread(s, fmt="{:.2f}") -> str:
    return f"{fmt.format(s.median)} ({fmt.format(s.min)}-{fmt.format(s.max)})"


def _shared_prefix_table(results: list[ProfileResult]) -> list[str]:
    """The profiles whose records share more than one record's prompt: the grouped and trie modes against
    paired-packed and against per-record sharing, each with its ideal (the trie's ideal also where it did not
    run)."""
    rows = [r for r in results if r.ideals and (r.grouped or r.ideals["trie"] > r.ideals["grouped"] * 1.001)]
    if not rows:
        return []
    lines = ["", "## Records that share prompts or prefixes (grouped-packed = --group_by_prompt; trie-packed = a token "
             "trie across records, --prefix_tree)", "",
             "| profile | shared-packed/paired-packed | ideal (per record) | grouped-packed/paired-packed | ideal | "
             "achieved/ideal | grouped-packed/shared-packed | ideal (grouping alone) | achieved/ideal | "
             "trie-packed/paired-packed | ideal (trie) | achieved/ideal | trie-packed/shared-packed | achieved/ideal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ideals = r.ideals
        cells = [r.name, _spread(r.speedups["shared_packed_vs_paired_packed"]), f"{ideals['per_record']:.2f}"]
        over = r.grouped_over_ideal()
        cells += ([_spread(r.speedups["grouped_packed_vs_paired_packed"]), f"{ideals['grouped']:.2f}",
                   f"{over['vs_paired_packed']:.2f}", _spread(r.speedups["grouped_packed_vs_shared_packed"]),
                   f"{ideals['grouped'] / ideals['per_record']:.2f}", f"{over['vs_shared_packed']:.2f}"]
                  if over else ["-"] * 6)
        over = r.trie_over_ideal()
        cells += ([_spread(r.speedups["trie_packed_vs_paired_packed"]), f"{ideals['trie']:.2f}",
                   f"{over['vs_paired_packed']:.2f}", _spread(r.speedups["trie_packed_vs_shared_packed"]),
                   f"{over['vs_shared_packed']:.2f}"]
                  if over else ["-", f"{ideals['trie']:.2f}", "-", "-", "-"])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _roofline_table(results: list[ProfileResult]) -> list[str]:
    """Each mode's useful GFLOP/s and its share of this device's matmul rate, per profile (`bench.roofline`)."""
    rows = [r for r in results if r.roofline is not None]
    if not rows:
        return []
    lines = ["", f"## Roofline: useful GFLOP/s per mode, and its share of this device's {rows[0].roofline.matmul} "
             "matmul rate (per-pass ratios)", "",
             "| profile | matmul GFLOP/s | mode | useful GFLOP per pass | useful GFLOP/s | share of matmul |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        roof = r.roofline
        for m in r.modes:
            lines.append(f"| {r.name} | {_spread(roof.matmul_gflops, '{:.0f}')} | {m} | {roof.useful_gflop[m]:.1f} | "
                         f"{_spread(roof.useful_gflops[m], '{:.1f}')} | {_spread(roof.share[m], '{:.0%}')} |")
    return lines


def markdown_report(results: list[ProfileResult], meta: dict) -> str:
    """Two tables: per profile and mode (throughput, memory, padding), and the speedups vs the paper's."""
    lines = ["# prefixdpo bench", ""]
    for key in ("task", "device", "model", "settings", "memory", "timing"):
        if key in meta:
            lines.append(f"- **{key}**: {meta[key]}")
    lines += ["", "## Throughput per mode (median (min-max) over the counted passes)", "",
              "| profile | mode | pairs/s | tokens/s | peak mem MB | lines | fill | collate ms/step |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for m, mr in r.modes.items():
            lines.append(
                f"| {r.name} | {m} | {_spread(mr.pairs_per_s)} | {_spread(mr.tokens_per_s, '{:.0f}')} | "
                f"{mr.peak_mb:.0f} | {mr.lines} | {mr.fill:.0%} | {mr.collate_ms_per_step:.1f} |")
    lines += ["", "## Speedups (ours: median (min-max) of per-pass time ratios; paper: 8x H100, Flex+prefix "
              "sharing over FA3)", "",
              "| profile | shared/paired | paper unpacked | shared-packed/paired-packed | paper packed | "
              "shared-packed/paired | ideal (useful FLOPs) | achieved/ideal | aims met |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        paper_u = f"{r.paper['shared_vs_paired']:.2f}" if r.paper else "-"
        paper_p = f"{r.paper['shared_packed_vs_paired_packed']:.2f}" if r.paper else "-"
        met = aims(r)
        lines.append(
            f"| {r.name} | {_spread(r.speedups['shared_vs_paired'])} | {paper_u} | "
            f"{_spread(r.speedups['shared_packed_vs_paired_packed'])} | {paper_p} | "
            f"{_spread(r.speedups['shared_packed_vs_paired'])} | {r.ideal:.2f} | {r.achieved_over_ideal:.2f} | "
            f"{sum(met.values())}/{len(met)} |")
    lines += _shared_prefix_table(results)
    lines += _roofline_table(results)
    lines += ["", "## Workloads", "",
              "| profile | examples | steps | length scale | pack length | FLOP split standard (body/attn/head) | "
              "FLOP split shared |", "|---|---|---|---|---|---|---|"]
    for r in results:
        fs = {k: "/".join(f"{v[p]:.0%}" for p in ("body", "attention", "lm_head")) for k, v in r.flop_split.items()}
        pack = "one line per step" if r.pack_length is None else r.pack_length
        lines.append(f"| {r.name} | {r.examples} | {r.steps} | {r.length_scale:.2f} | {pack} | "
                     f"{fs['standard']} | {fs['shared']} |")
    lines += ["", "ideal = useful forward FLOPs of standard paired training / of prefix sharing on the same examples "
              "(real tokens; matmuls + attention over allowed query-key pairs; LM head where a response token is "
              "predicted, none for a reward model). achieved/ideal = shared-packed over paired-packed, divided by ideal. "
              "Aims: shared > paired; shared-packed/paired-packed >= the paper's packed speedup; "
              "achieved/ideal >= 0.9."]
    return "\n".join(lines) + "\n"
