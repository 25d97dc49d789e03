"""Block bookkeeping for the paged pool: free list, refcounts and the prefix cache.

Contract:
- A block is *free* (refcount 0, no cached content), *in use* (refcount >= 1), or *cached*
  (refcount 0 but holding a full prompt block registered in the prefix cache; reusable on a
  hit, evicted least-recently-freed first when the free list is empty).
- A cached block is identified by a hash chain: hash(parent's key, its block_size tokens); a
  hit also compares the stored tokens, so a hash collision can never serve wrong K/V.
- Only full blocks enter the cache, so a shared block is never written again.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.kv.protocol import OutOfKVCache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack, lowest block first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with refcount 0
        self._key_of: dict[int, int] = {}  # block -> chain key
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # block -> its tokens (cached blocks)
        self._block_of: dict[int, int] = {}  # chain key -> block

    def num_available(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    def num_in_use(self) -> int:
        return self.num_blocks - self.num_available()

    def num_cached(self) -> int:
        return len(self._block_of)

    @staticmethod
    def chain_keys(token_ids: list[int], block_size: int) -> list[int]:
        """Chain key of every full block of token_ids (key i covers blocks 0..i)."""
        keys, parent = [], 0
        for i in range(len(token_ids) // block_size):
            parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
            keys.append(parent)
        return keys

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available():
            raise OutOfKVCache(f"need {n} KV blocks, {self.num_available()} available")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
            self.refcount[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        """Gives back one reference to each block. The last block goes back first, so a run
        released together is taken again in its original order (a sequence rolled back and
        extended keeps consecutive blocks), and a cached chain is evicted from its end."""
        for block in reversed(blocks):
            if self.refcount[block] <= 0:
                raise ValueError(f"block {block} released more often than it was taken")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Takes (refcount + 1) the cached blocks holding the longest cached prefix of token_ids."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        bs = self.block_size
        for i, key in enumerate(self.chain_keys(token_ids, bs)):
            block = self._block_of.get(key)
            if block is None or self._tokens_of[block] != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block)
        for block in hits:
            if self.refcount[block] == 0:
                del self._evictable[block]
            self.refcount[block] += 1
        return hits

    def register(self, blocks: list[int], token_ids: list[int]) -> None:
        """Registers full blocks (block i holds token_ids[i*bs:(i+1)*bs]) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i, key in enumerate(self.chain_keys(token_ids, bs)):
            block = blocks[i]
            if block in self._key_of or key in self._block_of:
                continue  # already cached (this block, or an identical one elsewhere)
            self._key_of[block] = key
            self._block_of[key] = block
            self._tokens_of[block] = tuple(token_ids[i * bs:(i + 1) * bs])

    def _uncache(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._block_of[key]
        del self._tokens_of[block]
