"""`prefixdpo` command line: dispatches to the sub-command modules in `prefixdpo.commands`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys

from prefixdpo.commands import COMMANDS
from prefixdpo.core.engines import name_deepspeed_accelerator
from prefixdpo.errors import TrainingPreempted, UserError
from prefixdpo.training.versions import version_report, warn_if_untested

TRAINING_COMMANDS = ("train", "reward", "grpo", "rloo")  # those that write checkpoints


class PrintVersions(argparse.Action):
    """`prefixdpo --version`: `versions.version_report()` (read when asked: it looks up installed metadata)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_report())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixdpo",
        description="Exact, fast DPO-family preference tuning and reward-model training of Hugging Face models by "
                    "prefix sharing.",
    )
    parser.add_argument("--version", action=PrintVersions,
                        help="print prefixdpo's version and those of the libraries it runs on (with the ranges its "
                             "tests passed), then exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"prefixdpo.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"prefixdpo.commands.{name}":
                raise
            continue  # a command not built yet in this checkout
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    as_process = argv is None  # the console script or `python -m prefixdpo.cli`: this process is the command
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run_command(argv, as_process=as_process)
    except BaseException as err:  # a KeyboardInterrupt, or another error an import made of one
        if not interrupted_by_ctrl_c(err):
            raise
        return stopped_before_start(argv, as_process)


def stopped_before_start(argv: list[str], as_process: bool) -> int:
    """Ctrl-C while the command line is still importing its libraries (building the parser imports transformers
    and TRL: seconds): nothing was started, so nothing is lost. One line, exit 130."""
    command = next((a for a in argv if not a.startswith("-")), "train")
    if os.environ.get("RANK", "0") == "0":
        print(f"prefixdpo {command}: stopped at once by Ctrl-C before it started", file=sys.stderr, flush=True)
    if as_process:
        # CPython 3.11 marks a KeyboardInterrupt raised inside `exec`/`eval` of a string (dataclasses and
        # namedtuples build methods that way while modules import) as unhandled even once caught, and then
        # kills the process with SIGINT at exit instead of exiting 130: leave now, nothing is left to flush.
        sys.stdout.flush()
        os._exit(130)
    return 130


def interrupted_by_ctrl_c(err: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among `err`'s causes. A Ctrl-C that lands while a module builds a class can
    reach us as another error: CPython wraps it in "RuntimeError: Error calling __set_name__" (seen while torch
    imported `torch._logging`), and transformers' lazy import wraps that in a ModuleNotFoundError."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def exit_at_once_on_ctrl_c(argv: list[str], as_process: bool):
    """While a command process imports its libraries, a Ctrl-C ends it at once from the signal handler, instead of
    raising a KeyboardInterrupt inside whatever module is importing (which may turn it into another error, or leave
    a half-imported module behind). In-process callers (`main(argv)`) keep Python's own handler."""
    if not as_process or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield  # not this process's command line, or someone else handles Ctrl-C here
        return
    signal.signal(signal.SIGINT, lambda signum, frame: stopped_before_start(argv, as_process=True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_command(argv: list[str], as_process: bool = False) -> int:
    """Parse `argv` and run its command; -> the exit code (each expected way to end is one line, `main`)."""
    if argv[:1] == ["--version"]:  # at once: building the parser imports transformers and TRL (seconds)
        print(version_report())
        return 0
    with exit_at_once_on_ctrl_c(argv, as_process):
        parser = build_parser()
    if not argv:
        argv = ["train"]  # the embedded default: `prefixdpo` alone runs the demo training job
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "pass_through", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_argv = extra  # a pass-through command (train) parses these itself
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    warn_if_untested(args.command)  # a TRL / transformers / accelerate outside the tested ranges: one line
    name_deepspeed_accelerator()  # no DeepSpeed warning on a CPU run that does not use it (accelerate imports it)
    try:
        code = int(args.func(args) or 0)
        leave_process_group()
        return code
    except TrainingPreempted as err:
        # not finished: a non-zero code a scheduler reads as "run again"; said once, by the first process
        if os.environ.get("RANK", "0") == "0":
            print(f"prefixdpo {args.command}: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except (UserError, OSError) as err:
        if interrupted_by_ctrl_c(err):
            return stopped_during(args.command)
        # Bad input (an option, a record) or the environment (a missing file, a model name the hub does not
        # know) is reported as one line naming the problem. Anything else is a bug: its traceback propagates.
        print(f"prefixdpo {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    except BaseException as err:  # a KeyboardInterrupt, or another error an import made of one
        if not interrupted_by_ctrl_c(err):
            raise
        return stopped_during(args.command)


def stopped_during(command: str) -> int:
    """Ctrl-C outside training, or a second one during it: stopped at once. What was being saved stays in its
    hidden staging folder (never a torn checkpoint in view); the complete checkpoints are untouched. One line, 130."""
    if os.environ.get("RANK", "0") == "0":
        lost = (": the current step and any checkpoint being written are lost; complete checkpoints are intact "
                "(resume with --resume_from_checkpoint latest)" if command in TRAINING_COMMANDS else "")
        print(f"prefixdpo {command}: stopped at once by Ctrl-C{lost}", file=sys.stderr, flush=True)
    return 130


def leave_process_group() -> None:
    """After a command that finished: every rank waits for the others, then ends its process group, as PyTorch asks
    of a distributed program. Left to the interpreter's exit, gloo's worker threads still run while it finalises,
    and a rank whose work is done can abort ("terminate called without an active exception"); ended here, they
    stop first (what is left of the race is a worker dropping its last tensor reference late, which the test
    scripts cut off with `os._exit`, too abrupt for a command whose callers' exit handlers must run). A rank whose
    peer already stopped (it failed, and said so) has no group left to end: nothing more to do here."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.barrier()
        dist.destroy_process_group()
    except (RuntimeError, ValueError):  # a peer's connection closed: its own exit code tells what went wrong
        pass


if __name__ == "__main__":
    sys.exit(main())
