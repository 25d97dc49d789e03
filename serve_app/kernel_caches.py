"""Bounds the CPU kernel caches that otherwise grow a serving process's memory for a long time
(called by the replica before its engine loads).

oneDNN and PyTorch's ideep each keep a per-shape kernel cache (1024 entries by default); decoding
meets new shapes almost every step, so both filled with kernels never reused
(docs/performance-notes.md#kernel-caches). Both are read from the environment the first time
oneDNN runs, so the bound must be set before any model runs; values already set win.
"""

from __future__ import annotations

import os

KERNEL_CACHE_CAPACITY = 512  # per cache: holds speculative steps' shapes (docs/performance-notes.md#kernel-caches)
_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> dict[str, str]:
    """Sets both cache capacities unless the environment already does; returns what is in effect."""
    if capacity < 1:
        raise ValueError(f"kernel cache capacity must be >= 1, got {capacity}")
    for name in _VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in _VARIABLES}
