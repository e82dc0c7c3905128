"""Sub-commands of the `prefixdpo` CLI. Each module exposes `register(subparsers)`, which adds its parser
and sets `func=run` (a callable taking the parsed args and returning an exit code)."""

COMMANDS = ("train", "reward", "grpo", "rloo", "verify", "inspect", "bench")
