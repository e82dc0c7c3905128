"""The tools, a package of their own beside the library (`prefixdpo`): what measures, proves and demonstrates it.
`bench` (the benchmark of `prefixdpo bench`), `gpu_check` (`make gpu-check`), `demo` and `demo_grpo` (the embedded
defaults the training commands run without a model or a dataset). The library (`prefixdpo`'s core, data, dpo,
reward, grpo, training) never imports from here; the command line (`prefixdpo.commands`, `prefixdpo.cli`) exposes
the tools (tests/test_package_layout.py)."""
