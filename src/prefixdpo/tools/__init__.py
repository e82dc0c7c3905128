"""The tools wing: what measures, proves and demonstrates the library, apart from it. `bench` (the benchmark of
`prefixdpo bench`), `gpu_check` (`make gpu-check`), `demo` and `demo_grpo` (the embedded defaults the training
commands run without a model or a dataset). The library's floors (core, data, dpo, reward, grpo, training) never
import from here (tests/test_package_layout.py)."""
