"""A pass over token trees: a pool's view turned so that each tree node attends to the context
and its own ancestors only, at the position of its depth (engine/speculative/tree.py).

The nodes are written where a chain of the same length would be (node i at the sequence's
length + 1 + i, after the root); after acceptance the pool moves the accepted path's K/V into
place (`CachePool.move_rows`) and truncates the rest.
"""

from __future__ import annotations

import torch

from engine import host_sync
from engine.kv.protocol import KVView


def tree_view(view: KVView, starts: list[int], chunk_lens: list[int], parents: list[list[int] | None]) -> KVView:
    """`view` (of a pass over chunks [root, node 0, node 1, ...] at `starts`) with tree masks and
    positions. parents[b]: row b's tree (node i's parent, -1 the root), or None for a chain."""
    B, T = view.position_ids.shape
    L = view.key_len
    host = list(starts)  # [B] starts, then [B * T] depth of every query, then [B * T * T] ancestors
    depth_rows, ancestor_rows = [], []
    for b in range(B):
        c = chunk_lens[b]
        tree = parents[b] if parents[b] is not None else list(range(-1, c - 2))  # a chain: node i's parent i - 1
        depths = [0]  # the root
        anc = [[0] * T for _ in range(T)]
        anc[0][0] = 1
        for i, parent in enumerate(tree):
            depths.append(depths[parent + 1] + 1)
            anc[i + 1] = list(anc[parent + 1])
            anc[i + 1][i + 1] = 1
        for i in range(c, T):  # padded queries see themselves only (a scratch key): finite, unused
            anc[i][i] = 1
        depth_rows += depths + [0] * (T - c)
        ancestor_rows += [x for row in anc for x in row]
    packed = host_sync.upload(host + depth_rows + ancestor_rows, view.position_ids.device)  # one upload
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
