"""The contract every KV pool keeps, and the view the model writes and reads through.

A *slot* is one sequence's place in a pool; its *length*, the tokens whose K/V the pool holds.
A *view* covers one pass: each slot appends `chunk_len` tokens at its length (creating the view
advances it); `truncate_to` moves a length back (speculative rollback).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

from engine import host_sync

KEY_ALIGN = 64  # gathered key lengths are rounded up to a multiple of this (docs/performance-notes.md#key-alignment)
PER_HEAD_GATHER_ROWS = 2048  # on CPU, gathers of at least this many rows (B * L) run one index_select per head
GROUPED_READ_MIN_SAVED_ROWS = 4096  # read keys in length groups when that spares this many rows per layer


def power_of_two_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def aligned_key_len(n: int) -> int:
    """Key length of a gathered view: n rounded up to a multiple of KEY_ALIGN, so the attention
    matmuls meet a new shape once per KEY_ALIGN steps, not every step; extra keys are masked."""
    return -(-n // KEY_ALIGN) * KEY_ALIGN


class OutOfKVCache(RuntimeError):
    """The pool cannot hold the requested tokens. Nothing was allocated by the failing call."""


class KeyGroup(NamedTuple):
    """Sequences of a view that read their keys together."""

    index: torch.Tensor  # [b] positions in the batch
    read_rows: torch.Tensor  # [b, L] storage rows of their key positions
    key_len: int  # L


class AttentionGroup(NamedTuple):
    """The sequences one attention call covers and the mask of their queries."""

    index: torch.Tensor | None  # [b] positions in the batch (None: the whole batch, in order)
    read_rows: torch.Tensor | None  # [b, L] (None: the view's contiguous `read_slice`)
    mask: torch.Tensor | None  # [b, 1, T, L] bool (None: attend to all L)


class KVView:
    """Where one forward pass writes new K/V and what it attends to.

    write_rows: [B * T] flat storage row for each new token (padding goes to the scratch row).
    read_rows: [B, L] flat storage row for key position j of sequence b (padding: scratch row), or
      None when `read_slice` gives one contiguous range (B == 1, over consecutive blocks). Views
      over several sequences have L = aligned_key_len(longest); keys past a sequence's end are masked.
    groups: None (every sequence reads L keys), or a split of the batch into KeyGroups of
      similar length, each reading only as many keys as its longest member needs.
    input_ids, position_ids [B, T], last [B] (each chunk's last index): the pass's inputs, when the
      pool was given its tokens (they reach the device in the view's one upload); else None.
    """

    def __init__(self, storage: torch.Tensor, write_rows: torch.Tensor,
                 read_rows: torch.Tensor | None, read_slice: slice | None, key_len: int,
                 needs_mask: bool, groups: list[KeyGroup] | None = None):
        self.storage = storage  # [layers, 2, kv_heads, rows, head_dim]
        self.write_rows = write_rows
        self.read_rows = read_rows
        self.read_slice = read_slice
        self.key_len = key_len  # L
        self.needs_mask = needs_mask
        self.groups = groups
        self.causal_tail = False  # every row's queries are exactly its last T keys (a lower-right causal mask)
        self.mask_override: torch.Tensor | None = None  # [B, 1, T, L] a pass over token trees (kv/tree_view.py)
        self.input_ids: torch.Tensor | None = None  # [B, T] (padded rows: token 0)
        self.position_ids: torch.Tensor | None = None  # [B, T] (padded rows: position 0)
        self.last: torch.Tensor | None = None  # [B]

    def attention_mask(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        """[B, 1, T, L] bool (True = attend): key j is visible to a query at position p iff j <= p."""
        if self.mask_override is not None:
            return self.mask_override
        if not self.needs_mask:
            return None
        return _causal_mask(position_ids, self.key_len)

    def attention_groups(self, position_ids: torch.Tensor) -> list[AttentionGroup]:
        """The groups attention runs over, with their masks; position_ids [B, T]."""
        if self.groups is None:
            return [AttentionGroup(None, self.read_rows, self.attention_mask(position_ids))]
        return [AttentionGroup(g.index, g.read_rows, _causal_mask(position_ids[g.index], g.key_len))
                for g in self.groups]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, T, kv_heads, head_dim] new entries, stored at write_rows."""
        kv = self.storage[layer]  # [2, kv_heads, rows, head_dim]
        B, T = k.shape[:2]
        kv[0].index_copy_(1, self.write_rows, k.reshape(B * T, *k.shape[2:]).transpose(0, 1).to(kv.dtype))
        kv[1].index_copy_(1, self.write_rows, v.reshape(B * T, *v.shape[2:]).transpose(0, 1).to(kv.dtype))

    def read(self, layer: int, read_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values [kv_heads, b, L, head_dim] at read_rows [b, L] (None: the read_slice),
        contiguous: the storage is head-major, so one gather yields every head's block of
        b * L rows in place, and attention batches its matmuls over (kv_head, sequence)
        without copying keys or values into another order. Large gathers go one head at a time
        on CPU only (on a GPU each is a kernel launch: one gather there)."""
        kv = self.storage[layer]  # [2, kv_heads, rows, head_dim]
        if read_rows is None:
            return kv[0, :, self.read_slice].unsqueeze(1), kv[1, :, self.read_slice].unsqueeze(1)
        B, L = read_rows.shape
        heads = kv.shape[1]
        rows = read_rows.reshape(-1)  # [B * L]
        flat = kv.view(2 * heads, *kv.shape[2:])  # [2 * kv_heads, storage rows, D]
        if rows.numel() < PER_HEAD_GATHER_ROWS or flat.device.type != "cpu":
            both = flat.index_select(1, rows)  # [2 * kv_heads, B * L, D]
        else:
            both = flat.new_empty(2 * heads, rows.numel(), flat.shape[-1])  # [2 * kv_heads, B * L, D]
            for j in range(2 * heads):
                torch.index_select(flat[j], 0, rows, out=both[j])
        both = both.view(2, heads, B, L, -1)  # [2, kv_heads, B, L, D]
        return both[0], both[1]


def _causal_mask(position_ids: torch.Tensor, key_len: int) -> torch.Tensor:
    """[B, 1, T, L] bool: key j is visible to a query at position p iff j <= p."""
    keys = torch.arange(key_len, device=position_ids.device)  # [L]
    return (keys[None, None, :] <= position_ids[:, :, None]).unsqueeze(1)


@runtime_checkable
class CachePool(Protocol):
    """Contract of a KV pool (kv/paged.py; the slotted backend is its one-block-per-slot form).

    - `allocate_slot(token_ids)` reserves a slot for a sequence whose known tokens are
      `token_ids`; returns (slot, cached): the first `cached` tokens already have K/V (prefix
      cache hit; always < len(token_ids) so the last token is computed). Raises OutOfKVCache.
    - `free_slot(slot)` releases the slot and its storage (shared prefix blocks stay cached).
    - `ensure_capacity(slot, new_len)` makes room for the slot to reach `new_len` tokens; False
      (and nothing allocated) when the pool is out of room. Views call it themselves.
    - `view(slots, chunk_lens, width, tokens)` appends chunk_lens[i] tokens to slots[i] from its
      current length; the pass has `width` (>= max chunk) query rows, extra rows write to scratch.
      With `tokens` (each row's chunk padded to the width) the view also holds the pass's
      input_ids, position_ids and last, uploaded with its own indices in one copy.
    - `truncate_to(slot, new_len, keep_storage=False)` rolls a slot back; storage wholly past
      new_len is released, or with keep_storage stays the slot's (a speculative round's rejected
      tokens: the next round writes there again, so releasing it would only reopen it).
    - `free_token_capacity()` tokens that could still be stored (None = no shared limit).
    - `usage_fraction()` share of the pool's blocks in use; `num_used_blocks()` how many.
    - `register_prefix(slot, token_ids)` offers the slot's full blocks holding `token_ids`
      (a prompt prefix) to the prefix cache; a no-op where there is none.
    """

    def allocate_slot(self, token_ids: list[int]) -> tuple[int, int]: ...
    def free_slot(self, slot: int) -> None: ...
    def seq_len(self, slot: int) -> int: ...
    def ensure_capacity(self, slot: int, new_len: int) -> bool: ...
    def view(self, slots: list[int], chunk_lens: list[int], width: int | None = None,
             tokens: list[list[int]] | None = None) -> KVView: ...
    def move_rows(self, moves: list[tuple[int, int, int]]) -> None: ...
    def truncate_to(self, slot: int, new_len: int, keep_storage: bool = False) -> None: ...
    def free_token_capacity(self) -> int | None: ...
    def register_prefix(self, slot: int, token_ids: list[int]) -> None: ...
    def num_used_slots(self) -> int: ...
    def num_used_blocks(self) -> int: ...
    def usage_fraction(self) -> float: ...


def pad_single(view: KVView, width: int, chunk_len: int) -> KVView:
    """Widens a one-sequence view to `width` query rows (extra rows write to scratch)."""
    if width == chunk_len:
        return view
    scratch = view.storage.shape[3] - 1
    pad = torch.full((width - chunk_len,), scratch, dtype=view.write_rows.dtype, device=view.write_rows.device)
    view.write_rows = torch.cat([view.write_rows, pad])
    view.needs_mask = True
    return view


def single_view(storage: torch.Tensor, rows: torch.Tensor, length: int, chunk_len: int, read_slice: slice | None,
                width: int | None = None, tokens: list[list[int]] | None = None) -> KVView:
    """A one-sequence view over its storage rows [>= length + chunk_len] (a device-side row map the
    pool keeps); keys read as `read_slice` where one is given. With `tokens` [[width ids]], one
    upload of the ids, positions and last index."""
    n, c = length, chunk_len
    read_rows = None if read_slice is not None else rows[:n + c].view(1, n + c)
    view = pad_single(KVView(storage, rows[n:n + c], read_rows, read_slice, n + c, needs_mask=c > 1), width or c, c)
    view.causal_tail = c > 1 and (width or c) == c
    if tokens is not None:
        T = width or c
        positions = list(range(n, n + c)) + [0] * (T - c)
        inputs = host_sync.upload(tokens[0] + positions + [c - 1], storage.device)  # [2 * T + 1]
        view.input_ids, view.position_ids = inputs[:T].view(1, T), inputs[T:2 * T].view(1, T)
        view.last = inputs[2 * T:]  # [1]
    return view


def build_view(storage: torch.Tensor, lengths: list[int], chunk_lens: list[int], tables: list[list[int]],
               block_size: int, width: int | None = None, tokens: list[list[int]] | None = None) -> KVView:
    """Index tensors for one pass over B sequences, from one upload.

    lengths[b]: tokens already stored for sequence b; chunk_lens[b]: new tokens it appends;
    tables[b]: its blocks (position p is storage row tables[b][p // block_size] * block_size +
    p % block_size); tokens[b]: its chunk padded to the pass's width (the view's input_ids).
    """
    device = storage.device
    scratch = storage.shape[3] - 1
    B, T = len(lengths), max(width or 0, max(chunk_lens))
    totals = [n + c for n, c in zip(lengths, chunk_lens)]  # each sequence's key count after the pass
    longest = max(totals)
    key_len = aligned_key_len(longest)  # L
    members = _key_groups(totals, key_len)
    M = max(len(t) for t in tables)
    host = lengths + chunk_lens + [b for m in members or [] for b in m]  # [B], [B], [B if grouped]
    for t in tables:
        host += t + [0] * (M - len(t))  # [B * M]
    for ids in tokens or []:
        host += ids  # [B * T]
    packed = host_sync.upload(host, device)  # the pass's one upload
    start, count = packed[:B], packed[B:2 * B]  # [B] each
    order = packed[2 * B:3 * B] if members else None  # [B] the groups' members, group after group
    at = 3 * B if members else 2 * B
    table = packed[at:at + B * M].view(B, M)  # [B, M]
    steps = torch.arange(T, device=device)  # [T]
    write_pos = start[:, None] + steps[None, :]  # [B, T]
    write_ok = steps[None, :] < count[:, None]  # [B, T]
    keys = torch.arange(key_len, device=device).expand(B, key_len)  # [B, L]
    read_ok = keys < (start + count)[:, None]  # [B, L]

    def rows_at(pos: torch.Tensor) -> torch.Tensor:  # pos [B, X] -> rows [B, X]
        return table.gather(1, pos // block_size) * block_size + pos % block_size

    write_rows = torch.where(write_ok, rows_at(torch.where(write_ok, write_pos, 0)), scratch)  # [B, T]
    read_rows = torch.where(read_ok, rows_at(torch.where(read_ok, keys, 0)), scratch)  # [B, L]
    unmasked = T == 1 and len(set(lengths)) == 1 and key_len == longest
    groups = None
    if members:
        groups, first = [], 0
        for m in members:
            index = order[first:first + len(m)]  # [b]
            n = aligned_key_len(max(totals[b] for b in m))
            groups.append(KeyGroup(index, read_rows[index, :n], n))  # read_rows [b, L_g]
            first += len(m)
    view = KVView(storage, write_rows.reshape(-1), read_rows, None, key_len, needs_mask=not unmasked, groups=groups)
    view.causal_tail = not unmasked and groups is None and len(set(lengths)) == 1 and set(chunk_lens) == {T} \
        and key_len == longest
    if tokens is not None:
        view.input_ids = packed[at + B * M:].view(B, T)
        view.position_ids = torch.where(write_ok, write_pos, 0)  # [B, T]
        view.last = count - 1  # [B]
    return view


def _key_groups(totals: list[int], key_len: int) -> list[list[int]] | None:
    """Sequences grouped by the power of two at or above their key count, if that spares at
    least GROUPED_READ_MIN_SAVED_ROWS gathered rows; None otherwise (one group, as today).
    Each group keeps the first L_g columns of the view's read_rows, which cover its members'
    keys (the rest of their columns point at the scratch row)."""
    buckets: dict[int, list[int]] = {}
    for b, n in enumerate(totals):
        buckets.setdefault(max(KEY_ALIGN, power_of_two_at_least(n)), []).append(b)
    if len(buckets) == 1:
        return None
    members = [buckets[w] for w in sorted(buckets)]
    lens = [aligned_key_len(max(totals[b] for b in m)) for m in members]
    if len(totals) * key_len - sum(len(m) * n for m, n in zip(members, lens)) < GROUPED_READ_MIN_SAVED_ROWS:
        return None
    return members


def allocate_storage(num_layers: int, rows: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """K/V storage [layers, 2, kv_heads, rows + 1, head_dim]; the last row is scratch."""
    return torch.zeros(num_layers, 2, num_kv_heads, rows + 1, head_dim, dtype=dtype, device=device)
