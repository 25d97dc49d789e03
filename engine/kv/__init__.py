"""KV cache: pools (storage apart from bookkeeping) and the manager (manager.py) that owns every
request's KV and every change to the pools and the pending features (features.py)."""

from engine.kv.manager import KVManager
from engine.kv.paged import PagedKVPool
from engine.kv.protocol import CachePool, KVView, OutOfKVCache

__all__ = ["CachePool", "KVManager", "KVView", "OutOfKVCache", "PagedKVPool", "make_pool"]


def make_pool(backend: str, *, block_size: int, num_blocks: int | None, enable_prefix_caching: bool,
              **shape) -> CachePool:
    """A pool of `backend`; `shape`: num_layers, num_kv_heads, head_dim, max_slots, max_seq_len,
    dtype, device. "slotted" is the paged pool with one block of max_seq_len rows per slot: each
    sequence owns a contiguous region, nothing is shared (no prefix cache)."""
    if backend == "slotted":
        return PagedKVPool(**shape, block_size=shape["max_seq_len"], num_blocks=shape["max_slots"],
                           enable_prefix_caching=False)
    if backend == "paged":
        return PagedKVPool(**shape, block_size=block_size, num_blocks=num_blocks,
                           enable_prefix_caching=enable_prefix_caching)
    raise ValueError(f"kv_cache_backend must be 'slotted' or 'paged', got {backend!r}")
