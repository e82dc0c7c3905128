"""`python -m prefixdpo_tools.gpu_check` (what `make gpu-check` runs)."""

import importlib.util
import sys

if importlib.util.find_spec("torch") is None:  # before the sections import it: one line, not a traceback
    print("gpu-check: torch is not installed for this python: nothing checked")
    sys.exit(0)

from prefixdpo_tools.gpu_check.main import main  # noqa: E402 (after the check above)

sys.exit(main())
