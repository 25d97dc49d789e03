"""A pass over token trees: a pool's view turned so that each tree node attends to the context
and its own ancestors only, at the position of its depth (engine/token_tree.py).

A tree's columns are its root (column 0) and its nodes (column i + 1: node i), their K/V at
consecutive positions from the root's. A verify pass writes every column (the nodes where a chain
of the same length would be); after acceptance the pool moves the accepted path's K/V into place
(`CachePool.move_rows`) and truncates the rest. A drafting pass writes a tree's newest columns
after the ones earlier passes wrote (`first`: the column its chunk starts at).
"""

from __future__ import annotations

import torch

from engine import host_sync
from engine.kv.protocol import KVView
from engine.token_tree import TokenTree, unpack_bits


def tree_view(view: KVView, starts: list[int], chunk_lens: list[int], trees: list[TokenTree | None],
              first: list[int] | None = None) -> KVView:
    """`view` (of a pass over chunks at `starts`) with tree masks and positions. Row b's chunk is
    trees[b]'s columns first[b].. (0 by default: the root and every node), so its root sits at
    starts[b] - first[b]; keys before the root are context. trees[b] None: a chain (each token
    sees the context and the tokens before it)."""
    B, T = view.position_ids.shape
    L = view.key_len
    first = first if first is not None else [0] * B
    C = max([T] + [f + c for f, c in zip(first, chunk_lens)])  # tree columns a row may have
    depths = [0] * (B * T)  # each query's depth (padded queries: 0)
    visible = [1] * (B * T)  # bit j: the query may see column j (padded queries: the root only, and the context)
    for b, (f, c, tree) in enumerate(zip(first, chunk_lens, trees)):
        if tree is None:  # a chain: column j sees columns 0..j
            depths[b * T:b * T + c] = range(f, f + c)
            visible[b * T:b * T + c] = [(1 << (j + 1)) - 1 for j in range(f, f + c)]
        else:
            depths[b * T:b * T + c] = ((0,) + tree.depths)[f:f + c]
            visible[b * T:b * T + c] = tree.ancestor_bits[f:f + c]
    ancestors = unpack_bits(visible, C)  # [B * T, C]
    roots = [s - f for s, f in zip(starts, first)]
    packed = host_sync.upload(torch.cat([torch.tensor(roots + depths, dtype=torch.int64), ancestors.reshape(-1).long()]),
                              view.position_ids.device)  # one upload
    root = packed[:B]  # [B] each root's key position
    depth = packed[B:B + B * T].view(B, T)  # [B, T]
    ancestors = packed[B + B * T:].view(B, T, C).bool()  # [B, T, C]
    steps = torch.arange(T, device=root.device)  # [T]
    real = steps[None, :] < (view.last + 1)[:, None]  # [B, T] the chunk's queries (the rest: padding)
    view.position_ids = torch.where(real, root[:, None] + depth, 0)  # [B, T]
    rel = torch.arange(L, device=root.device)[None, None, :] - root[:, None, None]  # [B, 1, L] key - root
    in_tree = (rel >= 0) & (rel < C)  # [B, 1, L]
    tree_part = ancestors.gather(2, rel.clamp(0, C - 1).expand(B, T, L))  # [B, T, L]
    view.mask_override = ((rel < 0) | (in_tree & tree_part)).unsqueeze(1)  # [B, 1, T, L]
    view.groups = None  # every row reads all L keys under its tree mask
    view.needs_mask = True
    view.causal_tail = False
    return view
