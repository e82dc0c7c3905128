"""The results of `make gpu-check`: one `CheckResult` per check, the table on stdout, the reports on disk
(gpu-check.json with every number, gpu-check.md) and the exit status."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefixdpo.atomic_io import atomic_write_text

__all__ = ["TABLES", "CheckResult", "format_table", "markdown_report", "verdict", "exit_status", "write_reports",
           "guarded"]

TABLES = ("verify", "train", "bench", "grpo verify", "grpo bench")  # the results' sections, in report order
FAILING = ("FAIL", "error")


@dataclass
class CheckResult:
    """One line of the table. status: ok | FAIL | error | n/a (unsupported by design) | skipped (time)."""

    section: str
    name: str
    status: str
    detail: str = ""
    numbers: dict = field(default_factory=dict)


def format_table(results: list[CheckResult]) -> str:
    """Fixed-width text table: section, check, status, detail (one line per check)."""
    header = ("section", "check", "status", "detail")
    rows = [header] + [(r.section, r.name, r.status, r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:{widths[0]}}  {b:{widths[1]}}  {c:{widths[2]}}  {d}".rstrip() for a, b, c, d in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def markdown_report(results: list[CheckResult], meta: dict) -> str:
    """Markdown: the run's facts, then one table per section, then the verdict."""
    lines = ["# prefixdpo gpu-check", ""] + [f"- {k}: {v}" for k, v in meta.items()]
    for section in TABLES:
        rows = [r for r in results if r.section == section]
        if not rows:
            continue
        lines += ["", f"## {section}", "", "| check | status | detail |", "|---|---|---|"]
        lines += [f"| {r.name} | {r.status} | {r.detail.replace('|', '/')} |" for r in rows]
    lines += ["", f"verdict: {verdict(results)}", ""]
    return "\n".join(lines)


def _is_exactness(section: str) -> bool:
    """verify, train, grpo verify: checks that fail the run; the benches only measure."""
    return not section.endswith("bench")


def verdict(results: list[CheckResult]) -> str:
    bad = [r for r in results if _is_exactness(r.section) and r.status in FAILING]
    return f"FAIL: {len(bad)} exactness check(s) failed" if bad else "all exactness checks passed"


def exit_status(results: list[CheckResult]) -> int:
    """1 if an exactness check (verify, train, grpo verify) failed or raised; bench results never fail the run."""
    return int(any(_is_exactness(r.section) and r.status in FAILING for r in results))


def write_reports(results: list[CheckResult], meta: dict, out: str | os.PathLike) -> list[Path]:
    """Write DIR/gpu-check.json (every number) and DIR/gpu-check.md; returns their paths."""
    out = Path(out)
    js, md = out / "gpu-check.json", out / "gpu-check.md"
    atomic_write_text(str(js), json.dumps({"meta": meta, "verdict": verdict(results),
                                           "results": [asdict(r) for r in results]}, indent=2))
    atomic_write_text(str(md), markdown_report(results, meta))
    return [js, md]


def guarded(section: str, name: str, fn, *args) -> CheckResult:
    """`fn(*args)`, or an `error` result with its message where it raises (`n/a` where the backend cannot run the
    check's dtype)."""
    from prefixdpo.core.attention.varlen import UnsupportedDtypeError

    try:
        return fn(*args)
    except UnsupportedDtypeError as err:  # varlen in float32: the backend cannot run this dtype, nothing to check
        return CheckResult(section, name, "n/a", str(err))
    except Exception as err:  # noqa: BLE001  (an exactness check that raises is a failure with its message)
        return CheckResult(section, name, "error", f"{type(err).__name__}: {err}"[:300])


def fresh_compile_state() -> None:
    """Forget every graph dynamo compiled so far, so that a bench run compiles (in its warm-up) what one training
    process would: the exactness checks before it compile flex_attention for many models, dtypes and grad modes, and
    their variants would count against the ones a run needs (`prefixdpo.core.attention.flex_compile`)."""
    import torch

    torch._dynamo.reset()
