"""`python -m prefixdpo.tools.gpu_check` (what `make gpu-check` runs)."""

import sys

from prefixdpo.tools.gpu_check.main import main

sys.exit(main())
