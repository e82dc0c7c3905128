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

    def __init__(self, step: int, max_steps: int, checkpoint: str):
        super().__init__(f"preempted at step {step} of {max_steps}: checkpoint saved to {checkpoint}; resume with "
                         "--resume_from_checkpoint latest")
        self.step, self.max_steps, self.checkpoint = step, max_steps, checkpoint
