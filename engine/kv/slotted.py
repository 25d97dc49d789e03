"""Slotted pool: each slot owns a contiguous region of `max_seq_len` rows."""

from __future__ import annotations

import torch

from engine.kv.protocol import KVView, OutOfKVCache, PoolViews, allocate_storage, build_view, pad_single


class SlottedKVPool(PoolViews):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_slots: int,
                 max_seq_len: int, dtype: torch.dtype, device: torch.device | str):
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.storage = allocate_storage(num_layers, max_slots * max_seq_len, num_kv_heads,
                                        head_dim, dtype, device)
        self._free = list(range(max_slots - 1, -1, -1))  # stack, lowest slot first
        self._lengths: dict[int, int] = {}

    def allocate_slot(self, token_ids: list[int]) -> tuple[int, int]:
        if len(token_ids) > self.max_seq_len:
            raise OutOfKVCache(f"sequence of {len(token_ids)} tokens exceeds max_seq_len {self.max_seq_len}")
        if not self._free:
            raise OutOfKVCache("no free slot")
        slot = self._free.pop()
        self._lengths[slot] = 0
        return slot, 0

    def free_slot(self, slot: int) -> None:
        if self._lengths.pop(slot, None) is None:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def seq_len(self, slot: int) -> int:
        return self._lengths[slot]

    def ensure_capacity(self, slot: int, new_len: int) -> bool:
        return new_len <= self.max_seq_len

    def view(self, slots: list[int], chunk_lens: list[int], width: int | None = None) -> KVView:
        lengths = [self._lengths[s] for s in slots]
        for s, n, c in zip(slots, lengths, chunk_lens):
            if n + c > self.max_seq_len:
                raise OutOfKVCache(f"slot {s}: {n} + {c} tokens exceed max_seq_len {self.max_seq_len}")
        for s, n, c in zip(slots, lengths, chunk_lens):
            self._lengths[s] = n + c
        if len(slots) == 1:  # one contiguous range: read it as a slice, no gather
            base = slots[0] * self.max_seq_len
            n, c = lengths[0], chunk_lens[0]
            rows = torch.arange(base + n, base + n + c, device=self.storage.device)
            view = KVView(self.storage, rows, None, slice(base, base + n + c), n + c, needs_mask=c > 1)
            return pad_single(view, width or c, c)
        bases = torch.tensor(slots, device=self.storage.device) * self.max_seq_len  # [B]
        return build_view(self.storage, lengths, chunk_lens, lambda pos: bases[:, None] + pos, width)

    def truncate_to(self, slot: int, new_len: int) -> None:
        if not 0 <= new_len <= self._lengths[slot]:
            raise ValueError(f"truncate_to: new_len must be in [0, {self._lengths[slot]}], got {new_len}")
        self._lengths[slot] = new_len

    def free_token_capacity(self) -> int | None:
        return None

    def register_prefix(self, slot: int, token_ids: list[int]) -> None:
        return None

    def num_used_slots(self) -> int:
        return len(self._lengths)

    def num_free_slots(self) -> int:
        return len(self._free)

    def usage_fraction(self) -> float:
        return len(self._lengths) / self.max_slots
