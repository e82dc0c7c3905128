"""`make gpu-check`: the GPU route proved in one command (`python -m prefixdpo.tools.gpu_check`; see `main`).

- `main`: the command, its sections, plan and budget;
- `dpo`: the DPO checks (verify, train, QLoRA, bench); `grpo`: the GRPO checks (imported only where TRL is);
- `results`: a check's result, the table, the reports and the exit status; `tiny_models`: the models checked.

The names below are the command's public face, as one module had them.
"""

from prefixdpo.tools.gpu_check.dpo import (
    ARCHS, BENCH_SHAPE, DTYPES, QLORA_CHECK, TRAIN_LOSS_TOL, TRAIN_STEPS, qlora_check, train_check, verify_check,
)
from prefixdpo.tools.gpu_check.main import (
    GRPO_ARCHS, GRPO_PROFILES, SECTIONS, attention_backends, grpo_section, main, planned_checks,
)
from prefixdpo.tools.gpu_check.results import (
    CheckResult, exit_status, format_table, markdown_report, verdict, write_reports,
)

__all__ = [
    "ARCHS", "DTYPES", "BENCH_SHAPE", "QLORA_CHECK", "TRAIN_LOSS_TOL", "TRAIN_STEPS", "GRPO_ARCHS", "GRPO_PROFILES",
    "SECTIONS", "CheckResult", "attention_backends", "planned_checks", "verify_check", "train_check", "qlora_check",
    "grpo_section", "format_table", "markdown_report", "verdict", "write_reports", "exit_status", "main",
]
