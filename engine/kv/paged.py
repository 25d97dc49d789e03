"""Paged pool: sequences own lists of fixed-size blocks (block tables) over shared storage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import host_sync
from engine.kv.block_manager import BlockManager
from engine.kv.protocol import KVView, OutOfKVCache, allocate_storage, build_view, single_view


@dataclass
class BlockTable:
    """One slot's blocks and what is stored in them."""

    blocks: list[int]
    length: int  # tokens with K/V
    prefix_blocks: int  # leading blocks shared through the prefix cache (never truncated)
    rows: torch.Tensor | None  # [len(blocks) * block_size] storage row of every position the blocks hold, on
    # the device; None until a one-sequence view needs it (batched views upload the block table instead),
    # then extended as blocks are added
    consecutive: bool  # blocks numbered one after another: keys read as one slice of storage


def _consecutive(blocks: list[int]) -> bool:
    return all(b == blocks[0] + i for i, b in enumerate(blocks))


class PagedKVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_slots: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device | str, block_size: int = 16, num_blocks: int | None = None,
                 enable_prefix_caching: bool = True):
        num_blocks = max_slots * -(-max_seq_len // block_size) if num_blocks is None else num_blocks
        self.block_size, self.max_slots, self.max_seq_len = block_size, max_slots, max_seq_len
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.storage = allocate_storage(num_layers, num_blocks * block_size, num_kv_heads, head_dim, dtype, device)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._tables: dict[int, BlockTable] = {}
        self._block_rows = torch.arange(block_size, device=self.storage.device)  # [block_size]

    def _rows_of_blocks(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks) * block_size] storage rows of the positions these blocks hold: a block or
        two (a sequence growing) built on the device, more from one upload of the block ids."""
        if 0 < len(blocks) <= 2:
            return torch.cat([self._block_rows + b * self.block_size for b in blocks])
        starts = host_sync.upload(blocks, self.storage.device, torch.long) * self.block_size  # [n]
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
        self._tables[slot] = BlockTable(hits, len(hits) * self.block_size, len(hits), None, _consecutive(hits))
        return slot, len(hits) * self.block_size

    def free_slot(self, slot: int) -> None:
        table = self._tables.pop(slot, None)
        if table is None:
            raise ValueError(f"slot {slot} is not allocated")
        self.blocks.release(table.blocks)
        self._free_slots.append(slot)

    def seq_len(self, slot: int) -> int:
        return self._tables[slot].length

    def block_table(self, slot: int) -> list[int]:
        return list(self._tables[slot].blocks)

    def ensure_capacity(self, slot: int, new_len: int) -> bool:
        if new_len > self.max_seq_len:
            return False
        table = self._tables[slot]
        missing = self._blocks_for(new_len) - len(table.blocks)
        if missing <= 0:
            return True
        if missing > self.blocks.num_available():
            return False
        new_blocks = self.blocks.allocate(missing)
        table.consecutive = table.consecutive and _consecutive(table.blocks[-1:] + new_blocks)
        table.blocks.extend(new_blocks)
        if table.rows is not None:  # the row map grows on the device (no upload)
            table.rows = torch.cat([table.rows, self._rows_of_blocks(new_blocks)])
        return True

    def view(self, slots: list[int], chunk_lens: list[int], width: int | None = None,
             tokens: list[list[int]] | None = None) -> KVView:
        tables = [self._tables[s] for s in slots]
        lengths = [t.length for t in tables]
        needed = sum(max(0, self._blocks_for(n + c) - len(t.blocks)) for t, n, c in zip(tables, lengths, chunk_lens))
        if needed > self.blocks.num_available():
            raise OutOfKVCache(f"need {needed} KV blocks, {self.blocks.num_available()} available")
        for s, t, n, c in zip(slots, tables, lengths, chunk_lens):
            if not self.ensure_capacity(s, n + c):
                raise OutOfKVCache(f"slot {s}: {n} + {c} tokens exceed max_seq_len {self.max_seq_len}")
            t.length = n + c
        if len(slots) == 1:  # one sequence: its row map on the device, sliced (no index arithmetic)
            t, n, c = tables[0], lengths[0], chunk_lens[0]
            if t.rows is None:
                t.rows = self._rows_of_blocks(t.blocks)
            read_slice = None
            if t.consecutive:  # keys read as a slice of storage, not gathered
                first = t.blocks[0] * self.block_size
                read_slice = slice(first, first + n + c)
            return single_view(self.storage, t.rows, n, c, read_slice, width, tokens)
        return build_view(self.storage, lengths, chunk_lens, [t.blocks for t in tables], self.block_size, width,
                          tokens)

    def move_rows(self, moves: list[tuple[int, int, int]]) -> None:
        """Copies the K/V at position src of a slot to its position dst, every layer, for each
        (slot, src, dst) in `moves` (all read before any is written; one copy for all): the
        accepted paths of token trees into place."""
        moves = [m for m in moves if m[1] != m[2]]
        if not moves:
            return
        bs = self.block_size
        src, dst = [], []
        for slot, a, b in moves:
            t = self._tables[slot]
            if max(a, b) >= t.length:
                raise ValueError(f"move_rows: positions must be below slot {slot}'s length {t.length}, got {a} -> {b}")
            src.append(t.blocks[a // bs] * bs + a % bs)
            dst.append(t.blocks[b // bs] * bs + b % bs)
        index = host_sync.upload(src + dst, self.storage.device, torch.long)  # [2 * n]
        n = len(moves)
        self.storage.index_copy_(3, index[n:], self.storage.index_select(3, index[:n]))

    def truncate_to(self, slot: int, new_len: int, keep_storage: bool = False) -> None:
        t = self._tables[slot]
        if not 0 <= new_len <= t.length:
            raise ValueError(f"truncate_to: new_len must be in [0, {t.length}], got {new_len}")
        keep = self._blocks_for(new_len)
        if keep < t.prefix_blocks:
            raise ValueError(f"truncate_to({new_len}) would cut into the {t.prefix_blocks} "
                             "shared prefix blocks of this slot")
        if len(t.blocks) > keep and not keep_storage:
            self.blocks.release(t.blocks[keep:])
            del t.blocks[keep:]
            t.rows = None if t.rows is None else t.rows[:keep * self.block_size]
            t.consecutive = t.consecutive or _consecutive(t.blocks)
        t.length = new_len

    def free_token_capacity(self) -> int | None:
        """None when a block holds a whole sequence: a slot never competes for more."""
        return None if self.block_size >= self.max_seq_len else self.blocks.num_available() * self.block_size

    def register_prefix(self, slot: int, token_ids: list[int]) -> None:
        """Caches the slot's full blocks holding token_ids (must already be computed)."""
        t = self._tables[slot]
        n_full = min(len(token_ids), t.length) // self.block_size
        if n_full == 0:
            return
        self.blocks.register(t.blocks[:n_full], token_ids[:n_full * self.block_size])
        t.prefix_blocks = max(t.prefix_blocks, n_full)

    def num_used_slots(self) -> int:
        return len(self._tables)

    def num_used_blocks(self) -> int:
        return self.blocks.num_in_use()

    def usage_fraction(self) -> float:
        return self.blocks.num_in_use() / self.blocks.num_blocks
