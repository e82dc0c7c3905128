"""Benchmarks: the side-by-side standard vs prefix-shared runs (the useful-FLOP model is
`prefixdpo_tools.bench.flops`)."""
