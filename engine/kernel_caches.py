"""Bounds the CPU kernel caches that otherwise grow a serving process's memory for a long time.

On CPU, bf16 matmuls run through oneDNN, which keeps two per-shape caches: oneDNN's own primitive
cache and ideep's computation cache in PyTorch (each 1024 entries by default). Decoding meets a
new shape at almost every step -- the attention matmuls are as wide as the longest context in the
batch -- so both caches fill with kernels that are never reused, and a replica's RSS climbed by
hundreds of MiB over minutes of load before levelling off. Measured with 32 concurrent requests
on the shipped pair: 1,000 steps added 153 MiB with the defaults and 0 MiB with both bounded.

Both are read from the environment the first time oneDNN runs in the process, so the bound must be
set before any model runs; values already in the environment win.
"""

from __future__ import annotations

import os

KERNEL_CACHE_CAPACITY = 64  # per cache; the shapes a decode step reuses fit in far fewer
_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> dict[str, str]:
    """Sets both cache capacities unless the environment already does; returns what is in effect."""
    if capacity < 1:
        raise ValueError(f"kernel cache capacity must be >= 1, got {capacity}")
    for name in _VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in _VARIABLES}
