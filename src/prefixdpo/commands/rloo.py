"""`prefixdpo rloo ...`: RLOO (TRL 1.16's `RLOOTrainer`) with prefix sharing; the same options and embedded
default as `prefixdpo grpo` (see `commands/grpo.py`), with TRL's `RLOOConfig` fields."""

from __future__ import annotations

from prefixdpo.commands.grpo import _usage, run


def register(subparsers) -> None:
    p = subparsers.add_parser("rloo", add_help=False, usage=_usage("rloo"),
                              help="RLOO with prefix sharing (TRL's RLOOTrainer; no arguments: the embedded demo)")
    p.set_defaults(func=run, pass_through=True, group_method="rloo")
