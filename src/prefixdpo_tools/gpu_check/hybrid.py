"""The hybrid section of `make gpu-check`: recurrent layers on shared prefixes, on CUDA.

Tiny Qwen3.5 (Gated DeltaNet), LFM2 (short convolutions), NemotronH, Falcon-H1, Zamba2 and a pure Mamba2 (Mamba2),
Kimi Linear (Kimi Delta Attention) and gpt-oss (attention sinks, a 16-token window) from
`prefixdpo_tools.hybrid_models`, in fp32 and bf16, per GPU attention backend: `prefixdpo verify`'s four cases (`gpu_check.dpo.verify_check`) on records long enough that every span
crosses the layers' chunk sizes (prompts of 150-200 tokens, responses of 40-90), so each response runs from its
prompt's final state through whatever kernel this machine has: the CUDA kernels transformers picks where installed
(`fla` for Gated DeltaNet and KDA, `causal-conv1d`, `mamba_ssm`), its torch paths elsewhere. The section's first line
names which were found. A family this transformers lacks, or a backend that refuses a model, is n/a.
"""

from __future__ import annotations

import importlib.util

from prefixdpo_tools.gpu_check.results import CheckResult, guarded

__all__ = ["FAMILIES", "DTYPES", "kernels_found", "hybrid_examples", "planned", "section"]

FAMILIES = ("qwen3_5_text", "lfm2", "nemotron_h", "falcon_h1", "zamba2", "mamba2", "kimi_linear", "gpt_oss")
DTYPES = ("float32", "bfloat16")
KERNEL_PACKAGES = ("fla", "causal_conv1d", "mamba_ssm")


def kernels_found() -> dict[str, bool]:
    """{package: importable} for the CUDA kernel packages transformers' hybrid layers use where installed."""
    return {name: importlib.util.find_spec(name) is not None for name in KERNEL_PACKAGES}


def hybrid_examples():
    """Three records, K = 2, 3, 2 (best vs each), prompts of 150-200 tokens, responses of 40-90 (vocab 96)."""
    import torch

    from prefixdpo.data.example import Example

    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, rs) in enumerate(((150, (70, 40)), (200, (90, 45, 60)), (170, (50, 80)))):
        ids = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (p, *rs)]
        out.append(Example(ids[0], ids[1:], pairs=[(0, k) for k in range(1, len(rs))], source_index=i))
    return out


def build_hybrid(family: str, dtype, device: str):
    from prefixdpo_tools.hybrid_models import tiny_hybrid_lm

    return tiny_hybrid_lm(family, dtype=dtype, device=device)


def planned(backends: list[str]) -> list[tuple[str, str]]:
    return [("hybrid", f"{f} {d} {b}") for f in FAMILIES for d in DTYPES for b in backends]


def _family_known(family: str) -> bool:
    from transformers import CONFIG_MAPPING

    return family in CONFIG_MAPPING


def section(backends: list[str], device: str, log=print) -> list[CheckResult]:
    """Every family x dtype x backend: verify's cases on `hybrid_examples()` (see the module doc)."""
    from prefixdpo_tools.gpu_check.dpo import verify_check

    found = kernels_found()
    log("hybrid: kernels " + ", ".join(f"{k} {'found' if v else 'absent (torch path)'}" for k, v in found.items()))
    examples = hybrid_examples()
    results = []
    for family in FAMILIES:
        for dtype in DTYPES:
            for b in backends:
                name = f"{family} {dtype} {b}"
                if not _family_known(family):
                    results.append(CheckResult("hybrid", name, "n/a", f"this transformers has no {family}"))
                else:
                    results.append(guarded("hybrid", name, verify_check, family, dtype, b, device,
                                           build_hybrid, examples, "hybrid"))
                log(f"  hybrid {results[-1].name}: {results[-1].status} {results[-1].detail}")
    return results
