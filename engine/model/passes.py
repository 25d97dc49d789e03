"""A forward pass over chunks of several sequences through a KV pool, and how prefill chunks are
grouped into passes."""

from __future__ import annotations

import torch

from engine.kv import CachePool
from engine.kv.protocol import power_of_two_at_least
from engine.model.llama import Llama

UNPADDED_MAX = 16  # passes up to this wide (decode, verify) keep their exact width


def padded_length(t: int) -> int:
    """Long chunks are padded to a power of two: a few shapes instead of one per length
    (docs/performance-notes.md#prefill-padding)."""
    return t if t <= UNPADDED_MAX else power_of_two_at_least(t)


def width_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` grouped by the power of two at or above each length, shortest first:
    passes over these groups pad no row to more than twice its length."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(power_of_two_at_least(n), []).append(i)
    return [groups[w] for w in sorted(groups)]


def forward_chunks(model: Llama, pool: CachePool, slots: list[int], chunks: list[list[int]],
                   start_positions: list[int], all_logits: bool = False) -> torch.Tensor:
    """Appends chunks[i] at start_positions[i] of slots[i] (which must equal its length).

    Returns logits of each chunk's last token [B, vocab], or of every position [B, T, vocab]
    when all_logits (rows shorter than T are padded; their extra positions are garbage).
    """
    longest = max(len(c) for c in chunks)
    T = padded_length(longest)
    pads = [[0] * (T - len(c)) for c in chunks]  # padded rows: token 0 at position 0, written to scratch
    ids = torch.tensor([c + pad for c, pad in zip(chunks, pads)], device=model.device)  # [B, T]
    pos = torch.tensor([list(range(s, s + len(c))) + pad for c, s, pad in zip(chunks, start_positions, pads)],
                       device=model.device)  # [B, T]
    view = pool.view(slots, [len(c) for c in chunks], width=T)
    if all_logits:
        return model.forward(ids, pos, view, None)[:, :longest]  # [B, longest, vocab]
    if T == 1:
        return model.forward(ids, pos, view, None)[:, 0]  # [B, vocab]
    last = torch.tensor([len(c) - 1 for c in chunks], device=model.device)  # [B]
    return model.forward(ids, pos, view, last)  # [B, vocab]
