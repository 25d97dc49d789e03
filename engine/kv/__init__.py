"""KV-cache pools: storage (flat tensors) kept apart from bookkeeping (slots, blocks, prefix cache)."""

from engine.kv.paged import PagedKVPool
from engine.kv.protocol import CachePool, KVView, OutOfKVCache
from engine.kv.slotted import SlottedKVPool

__all__ = ["CachePool", "KVView", "OutOfKVCache", "PagedKVPool", "SlottedKVPool", "make_pool"]


def make_pool(backend: str, **kwargs) -> CachePool:
    if backend == "slotted":
        kwargs.pop("block_size", None)
        kwargs.pop("num_blocks", None)
        kwargs.pop("enable_prefix_caching", None)
        return SlottedKVPool(**kwargs)
    if backend == "paged":
        return PagedKVPool(**kwargs)
    raise ValueError(f"kv_cache_backend must be 'slotted' or 'paged', got {backend!r}")
