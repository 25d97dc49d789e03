"""A pass over token trees: a pool's view turned so that each tree node attends to the context
and its own ancestors only, at the position of its depth (engine/speculative/tree.py).

The nodes are written where a chain of the same length would be (node i at the sequence's
length + 1 + i, after the root); after acceptance the pool moves the accepted path's K/V into
place (`CachePool.move_rows`) and truncates the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine import host_sync
from engine.kv.protocol import KVView

if TYPE_CHECKING:
    from engine.speculative.tree import TokenTree


def tree_view(view: KVView, starts: list[int], chunk_lens: list[int], trees: list[TokenTree | None]) -> KVView:
    """`view` (of a pass over chunks [root, node 0, node 1, ...] at `starts`) with tree masks and
    positions. trees[b]: row b's tree, or None for a chain."""
    B, T = view.position_ids.shape
    L = view.key_len
    depths = torch.zeros(B, T, dtype=torch.int64)  # [B, T] padded queries: depth 0
    ancestors = torch.eye(T, dtype=torch.int64).repeat(B, 1, 1)  # [B, T, T] padded queries see themselves only
    for b, (c, tree) in enumerate(zip(chunk_lens, trees)):
        if tree is None:  # a chain: each token sees those before it
            depths[b, :c] = torch.arange(c)
            ancestors[b, :c, :c] = torch.ones(c, c, dtype=torch.int64).tril()
        else:
            depths[b, 1:c] = torch.tensor(tree.depths, dtype=torch.int64)
            ancestors[b, :c, :c] = tree.ancestor_mask().long()
    packed = host_sync.upload(torch.cat([torch.tensor(starts, dtype=torch.int64), depths.view(-1), ancestors.view(-1)]),
                              view.position_ids.device)  # one upload
    start = packed[:B]  # [B]
    depth = packed[B:B + B * T].view(B, T)  # [B, T]
    ancestors = packed[B + B * T:].view(B, T, T).bool()  # [B, T, T] query i may see chunk key j
    steps = torch.arange(T, device=start.device)  # [T]
    real = steps[None, :] < (view.last + 1)[:, None]  # [B, T] the chunk's queries (the rest: padding)
    view.position_ids = torch.where(real, start[:, None] + depth, 0)  # [B, T]
    rel = torch.arange(L, device=start.device)[None, None, :] - start[:, None, None]  # [B, 1, L] key - start
    in_chunk = (rel >= 0) & (rel < T)  # [B, 1, L]
    tree_part = ancestors.gather(2, rel.clamp(0, T - 1).expand(B, T, L))  # [B, T, L]
    view.mask_override = ((rel < 0) | (in_chunk & tree_part)).unsqueeze(1)  # [B, 1, T, L]
    view.groups = None  # every row reads all L keys under its tree mask
    view.needs_mask = True
    view.causal_tail = False
    return view
