"""Benchmarks (not tests): side-by-side, interleaved, medians; JSON in bench/results/."""
