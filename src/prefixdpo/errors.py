"""Errors caused by the user's input, as opposed to bugs.

The command line prints a `UserError` as one line (`prefixdpo COMMAND: error: MESSAGE`) and exits 2;
any other exception is a bug and keeps its traceback (exit 1). The message must therefore name what the
user gave (the option, record or file) and what is wrong with it.

`UserError` derives from `ValueError` so that code (and tests) catching `ValueError` for bad input keep
working when a module's own error class is rebased onto it.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with the user's input: printed as one line, exit code 2, no traceback."""


class ConfigError(UserError):
    """An option (command line, YAML config or `PrefixDPOConfig` field) that is unknown or has a bad value."""


class TrainingPreempted(Exception):
    """A preemption signal (SIGTERM/SIGUSR1) stopped training after an optimizer step, and a complete
    checkpoint of that step was saved: the run is not finished. The command line exits with `exit_code`
    (75, EX_TEMPFAIL: "try again"), so a scheduler does not read the run as done."""

    exit_code = 75
    verb = "preempted"

    def __init__(self, step: int, max_steps: int, checkpoint: str):
        super().__init__(f"{self.verb} at step {step} of {max_steps}: checkpoint saved to {checkpoint}; resume with "
                         "--resume_from_checkpoint latest")
        self.step, self.max_steps, self.checkpoint = step, max_steps, checkpoint


class TrainingInterrupted(TrainingPreempted):
    """A first Ctrl-C (SIGINT) stopped training after an optimizer step, and a complete checkpoint of that step
    was saved. Exit code 130 (128 + SIGINT, what a shell reports for a job stopped by Ctrl-C), not 75: the user
    stopped the run on purpose, and a scheduler that retries on 75 must not start it again by itself."""

    exit_code = 130
    verb = "interrupted (Ctrl-C)"
