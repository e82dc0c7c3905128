"""Benchmarks: the useful-FLOP model (`flops`) and the side-by-side standard vs prefix-shared runs."""
