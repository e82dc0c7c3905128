"""prefixdpo: exact, fast DPO-family preference tuning by prefix sharing.

The prompt and all its responses run as one row; an attention rule keeps each response from seeing the
others, so per-response log-probs equal those of separate `[prompt][response]` passes.
"""

__version__ = "0.1.0"
