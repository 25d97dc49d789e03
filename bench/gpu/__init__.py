"""`python -m bench gpu`: the one-command check of the engine on a GPU (bench/gpu/check.py)."""

from bench.gpu.check import main

__all__ = ["main"]
