"""Run the strict equal-work test N times, each in a fresh pytest process, one after another; print the
failure count. An intermittent defect shows up here as a non-zero count.

    .venv/bin/python tests/repeat_strict_equal_work.py 200 [-k EXPR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=int)
    parser.add_argument("-k", default="every_mode_matches_stock", help="pytest -k expression")
    args = parser.parse_args()
    failures = 0
    for i in range(1, args.runs + 1):
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_bench.py", "-k", args.k],
            cwd=ROOT, capture_output=True, text=True,
        )
        if proc.returncode != 0:
            failures += 1
            print(f"run {i}: FAILED\n{proc.stdout[-3000:]}", flush=True)
        print(f"run {i}: {failures} failures so far", flush=True)
    print(f"{failures} of {args.runs} runs failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
