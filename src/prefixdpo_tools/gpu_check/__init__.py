"""`make gpu-check`: the GPU route proved in one command (`python -m prefixdpo_tools.gpu_check`; see `main`).

- `main`: the command, its sections, plan and budget;
- `dpo`: the DPO checks (verify, train, QLoRA, bench); `grpo`: the GRPO checks (imported only where TRL is);
- `results`: a check's result, the table, the reports and the exit status; `tiny_models`: the models checked.

The names below are the command's public face, as one module had them, loaded on first use (PEP 562): the
sections import torch, and `make gpu-check` on a python without it must get to its one line (`__main__`).
"""

import importlib

_HOMES = {
    "dpo": ("ARCHS", "DTYPES", "BENCH_SHAPE", "QLORA_CHECK", "TRAIN_LOSS_TOL", "TRAIN_STEPS", "qlora_check",
            "train_check", "verify_check"),
    "main": ("GRPO_ARCHS", "GRPO_PROFILES", "SECTIONS", "attention_backends", "grpo_section", "main",
             "planned_checks"),
    "results": ("CheckResult", "exit_status", "format_table", "markdown_report", "verdict", "write_reports"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = list(_HOME_OF)


def __getattr__(name: str):
    if name in _HOME_OF:
        return getattr(importlib.import_module(f"prefixdpo_tools.gpu_check.{_HOME_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
