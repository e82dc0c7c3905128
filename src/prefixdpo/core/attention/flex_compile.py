"""Room for FlexAttention's compiled variants, so that no pass falls back to its unfused path.

transformers compiles `flex_attention` once per process (`integrations.flex_attention.WrappedFlexAttention`), and
dynamo keeps one compiled variant per guard set of that one function: grad mode (the policy's pass with gradients,
the reference's and the old policy's without), training flag, dtype, and static-then-dynamic shapes. Past
`torch._dynamo.config.recompile_limit` (8 by default) dynamo stops compiling it and every new variant runs flex's
eager path, which materialises the whole [B, H, Lq, Lk] score matrix: measured on an H200 in `make gpu-check`
(torch 2.11), where the limit was hit ('GLOBAL_STATE changed: grad_mode'), the GRPO step ran 6x slower than TRL's.
A run of one model needs a handful of variants; the limit is raised so that a run with reuse chunks, evaluation and
generation never reaches it.
"""

from __future__ import annotations

import torch

FLEX_RECOMPILE_LIMIT = 64  # compiled variants of flex_attention one process may hold
FLEX_ACCUMULATED_RECOMPILE_LIMIT = 1024  # all of dynamo's recompiles in one process


def allow_flex_recompiles() -> None:
    """Raise dynamo's recompile limits to at least prefixdpo's (never lowers a limit the user set higher)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, FLEX_ACCUMULATED_RECOMPILE_LIMIT)
