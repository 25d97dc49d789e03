"""Paged pool: sequences own lists of fixed-size blocks (block tables) over shared storage."""

from __future__ import annotations

import torch

from engine.kv.block_manager import BlockManager
from engine.kv.protocol import KVView, OutOfKVCache, PoolViews, allocate_storage, build_view, pad_single


class PagedKVPool(PoolViews):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_slots: int,
                 max_seq_len: int, dtype: torch.dtype, device: torch.device | str,
                 block_size: int = 16, num_blocks: int | None = None,
                 enable_prefix_caching: bool = True):
        if num_blocks is None:
            num_blocks = max_slots * -(-max_seq_len // block_size)
        self.block_size = block_size
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.storage = allocate_storage(num_layers, num_blocks * block_size, num_kv_heads,
                                        head_dim, dtype, device)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}  # slot -> block table
        self._lengths: dict[int, int] = {}
        self._num_prefix_blocks: dict[int, int] = {}  # slot -> leading blocks shared via the cache
        self._rows: dict[int, torch.Tensor] = {}  # slot -> storage row of every position its blocks hold
        # slot -> whether its blocks are consecutive, so its keys read as one slice of storage
        self._consecutive: dict[int, bool] = {}
        self._block_rows = torch.arange(block_size, device=self.storage.device)  # [block_size]

    def _rows_of_blocks(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks) * block_size] storage rows of the positions these blocks hold."""
        if not blocks:
            return torch.empty(0, dtype=torch.long, device=self.storage.device)
        starts = torch.tensor(blocks, device=self.storage.device) * self.block_size  # [n]
        return (starts[:, None] + self._block_rows[None, :]).reshape(-1)

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def allocate_slot(self, token_ids: list[int]) -> tuple[int, int]:
        if len(token_ids) > self.max_seq_len:
            raise OutOfKVCache(f"sequence of {len(token_ids)} tokens exceeds max_seq_len {self.max_seq_len}")
        if not self._free_slots:
            raise OutOfKVCache("no free slot")
        # never take the whole sequence from the cache: the last token must be computed
        hits = self.blocks.match_prefix(token_ids[:-1]) if token_ids else []
        slot = self._free_slots.pop()
        self._tables[slot] = hits
        self._rows[slot] = self._rows_of_blocks(hits)
        self._consecutive[slot] = _consecutive(hits)
        self._lengths[slot] = len(hits) * self.block_size
        self._num_prefix_blocks[slot] = len(hits)
        return slot, self._lengths[slot]

    def free_slot(self, slot: int) -> None:
        if slot not in self._tables:
            raise ValueError(f"slot {slot} is not allocated")
        self.blocks.release(self._tables.pop(slot))
        del self._rows[slot]
        del self._consecutive[slot]
        del self._lengths[slot]
        del self._num_prefix_blocks[slot]
        self._free_slots.append(slot)

    def seq_len(self, slot: int) -> int:
        return self._lengths[slot]

    def block_table(self, slot: int) -> list[int]:
        return list(self._tables[slot])

    def ensure_capacity(self, slot: int, new_len: int) -> bool:
        if new_len > self.max_seq_len:
            return False
        table = self._tables[slot]
        missing = self._blocks_for(new_len) - len(table)
        if missing <= 0:
            return True
        if missing > self.blocks.num_available():
            return False
        new_blocks = self.blocks.allocate(missing)
        self._consecutive[slot] = self._consecutive[slot] and _consecutive(table[-1:] + new_blocks)
        table.extend(new_blocks)
        self._rows[slot] = torch.cat([self._rows[slot], self._rows_of_blocks(new_blocks)])
        return True

    def view(self, slots: list[int], chunk_lens: list[int], width: int | None = None) -> KVView:
        lengths = [self._lengths[s] for s in slots]
        needed = sum(max(0, self._blocks_for(n + c) - len(self._tables[s]))
                     for s, n, c in zip(slots, lengths, chunk_lens))
        if needed > self.blocks.num_available():
            raise OutOfKVCache(f"need {needed} KV blocks, {self.blocks.num_available()} available")
        for s, n, c in zip(slots, lengths, chunk_lens):
            if not self.ensure_capacity(s, n + c):
                raise OutOfKVCache(f"slot {s}: {n} + {c} tokens exceed max_seq_len {self.max_seq_len}")
            self._lengths[s] = n + c
        if len(slots) == 1:  # one sequence: its cached row map, sliced (no index arithmetic)
            rows = self._rows[slots[0]]
            n, c = lengths[0], chunk_lens[0]
            read_rows, read_slice = rows[:n + c].view(1, n + c), None
            if self._consecutive[slots[0]]:  # keys read as a slice of storage, not gathered
                first = self._tables[slots[0]][0] * self.block_size
                read_rows, read_slice = None, slice(first, first + n + c)
            view = KVView(self.storage, rows[n:n + c], read_rows, read_slice, n + c, needs_mask=c > 1)
            return pad_single(view, width or c, c)
        max_blocks = max(len(self._tables[s]) for s in slots)
        table = torch.tensor([self._tables[s] + [0] * (max_blocks - len(self._tables[s])) for s in slots],
                             device=self.storage.device)  # [B, max_blocks]
        bs = self.block_size

        def rows_at(pos: torch.Tensor) -> torch.Tensor:  # pos [B, X] -> rows [B, X]
            return table.gather(1, pos // bs) * bs + pos % bs

        return build_view(self.storage, lengths, chunk_lens, rows_at, width)

    def truncate_to(self, slot: int, new_len: int) -> None:
        if not 0 <= new_len <= self._lengths[slot]:
            raise ValueError(f"truncate_to: new_len must be in [0, {self._lengths[slot]}], got {new_len}")
        keep = self._blocks_for(new_len)
        if keep < self._num_prefix_blocks[slot]:
            raise ValueError(f"truncate_to({new_len}) would cut into the {self._num_prefix_blocks[slot]} "
                             "shared prefix blocks of this slot")
        table = self._tables[slot]
        if len(table) > keep:
            self.blocks.release(table[keep:])
            del table[keep:]
            self._rows[slot] = self._rows[slot][:keep * self.block_size]
            self._consecutive[slot] = self._consecutive[slot] or _consecutive(table)
        self._lengths[slot] = new_len

    def free_token_capacity(self) -> int | None:
        return self.blocks.num_available() * self.block_size

    def register_prefix(self, slot: int, token_ids: list[int]) -> None:
        """Caches the slot's full blocks holding token_ids (must already be computed)."""
        n_full = min(len(token_ids), self._lengths[slot]) // self.block_size
        if n_full == 0:
            return
        table = self._tables[slot]
        self.blocks.register(table[:n_full], token_ids[:n_full * self.block_size])
        self._num_prefix_blocks[slot] = max(self._num_prefix_blocks[slot], n_full)

    def num_used_slots(self) -> int:
        return len(self._tables)

    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def num_used_blocks(self) -> int:
        return self.blocks.num_in_use()

    def usage_fraction(self) -> float:
        return self.blocks.num_in_use() / self.blocks.num_blocks


def _consecutive(blocks: list[int]) -> bool:
    """Whether blocks are numbered one after another (their rows form one range of storage)."""
    return all(b == blocks[0] + i for i, b in enumerate(blocks))
