"""A forward pass over chunks of several sequences through a KV pool, and how prefill chunks are
grouped into passes."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from engine import host_sync
from engine.kv import CachePool, make_pool
from engine.kv.protocol import KVView, power_of_two_at_least
from engine.kv.tree_view import tree_view
from engine.model.packing import Packing, packed_positions
from engine.model.transformer import Transformer
from engine.token_tree import TokenTree

UNPADDED_MAX = 16  # passes up to this wide (decode, verify) keep their exact width
PAD_MULTIPLE = 32  # wider ones are padded to a multiple of this (docs/performance-notes.md#prefill-padding)


def padded_length(t: int) -> int:
    """A pass's width: exact up to UNPADDED_MAX, else rounded up to a multiple of PAD_MULTIPLE (a
    bounded number of shapes for little padding)."""
    return t if t <= UNPADDED_MAX else -(-t // PAD_MULTIPLE) * PAD_MULTIPLE


def width_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` grouped by the power of two at or above each length, shortest first:
    passes over these groups pad no row to more than twice its length."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(power_of_two_at_least(n), []).append(i)
    return [groups[w] for w in sorted(groups)]


class PassInputs(NamedTuple):
    """A pass over chunks of several sequences, padded to one width."""

    ids: torch.Tensor  # [B, T] token ids (padded rows: token 0)
    positions: torch.Tensor  # [B, T] (padded rows: position 0, written to the view's scratch row)
    view: KVView
    longest: int  # the longest chunk (T is it, padded)
    last: torch.Tensor  # [B] index of each chunk's last token
    packing: Packing | None = None  # an every-position pass whose linears compute the real tokens only


def pass_inputs(model: Transformer, pool: CachePool, slots: list[int], chunks: list[list[int]],
                start_positions: list[int], trees: list[TokenTree | None] | None = None,
                tree_from: list[int] | None = None, pack: bool = False) -> PassInputs:
    """Inputs for appending chunks[i] at start_positions[i] of slots[i] (which must equal its
    length), reaching the device with the view's indices in one upload. trees[i]: chunk i is the
    root and the nodes of that token tree, or with tree_from its columns from tree_from[i] on
    (kv/tree_view.py: a drafting pass over a tree's newest nodes); None: a chain. pack: the
    linears compute only the real tokens where that saves enough (packing.py)."""
    if any(pool.seq_len(s) != p for s, p in zip(slots, start_positions)):
        raise ValueError(f"chunks must start at their slots' lengths: {start_positions} vs "
                         f"{[pool.seq_len(s) for s in slots]}")
    longest = max(len(c) for c in chunks)
    T = padded_length(longest)
    view = pool.view(slots, [len(c) for c in chunks], width=T, tokens=[c + [0] * (T - len(c)) for c in chunks])
    if trees is not None and any(t is not None for t in trees):
        view = tree_view(view, start_positions, [len(c) for c in chunks], trees, tree_from)
    flat = packed_positions([len(c) for c in chunks], T) if pack else None
    packing = None if flat is None else Packing(host_sync.upload(flat, view.input_ids.device, torch.long), len(chunks), T)
    return PassInputs(view.input_ids, view.position_ids, view, longest, view.last, packing)


def packs(model: Transformer, lengths: list[int]) -> bool:
    """Whether an every-position pass over chunks of `lengths` computes only their tokens (eager
    passes, with enough padding; captured graphs replay the padded pass)."""
    return model.graphs is None and packed_positions(lengths, padded_length(max(lengths))) is not None


def computed_tokens(model: Transformer, lengths: list[int]) -> int:
    """Tokens an every-position pass over chunks of `lengths` runs its linears on."""
    return sum(lengths) if packs(model, lengths) else len(lengths) * padded_length(max(lengths))


def put_rows(rows: list[int], *pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """out[rows] = values for each (out, values) pair, the row index uploaded once (not at all
    where rows are every row of out, in order)."""
    if rows == list(range(pairs[0][0].shape[0])):
        for out, values in pairs:
            out.copy_(values)
        return
    index = host_sync.upload(rows, pairs[0][0].device, torch.long)  # [len(rows)]
    for out, values in pairs:
        out.index_copy_(0, index, values.to(out.dtype))


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] (x itself where rows are all of its rows, in order), the index uploaded once."""
    if rows == list(range(x.shape[0])):
        return x
    return x.index_select(0, host_sync.upload(rows, x.device, torch.long))


def forward_chunks(model: Transformer, pool: CachePool, slots: list[int], chunks: list[list[int]],
                   start_positions: list[int], all_logits: bool = False,
                   trees: list[TokenTree | None] | None = None, tree_from: list[int] | None = None) -> torch.Tensor:
    """Appends chunks[i] at start_positions[i] of slots[i] (which must equal its length); chunks
    that are token trees (or their newest nodes) as `pass_inputs` says.

    Returns logits of each chunk's last token [B, vocab], or of every position [B, T, vocab]
    when all_logits (rows shorter than T are padded; their extra positions are garbage).
    """
    x = pass_inputs(model, pool, slots, chunks, start_positions, trees, tree_from, pack=all_logits)
    replay = replayed(model, x)
    if replay is not None:
        return at_last(replay[0], x, all_logits)
    if all_logits:
        return model.forward(x.ids, x.positions, x.view, None, x.packing)[:, :x.longest]  # [B, longest, vocab]
    if x.ids.shape[1] == 1:
        return model.forward(x.ids, x.positions, x.view, None)[:, 0]  # [B, vocab]
    return model.forward(x.ids, x.positions, x.view, x.last)  # [B, vocab]


def replayed(model: Transformer, x: PassInputs, extra: torch.Tensor | None = None,
             layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...] | None:
    """The pass's every-position outputs [B, T, ...] replayed from the model's captured graphs
    (engine/model/cuda_graphs.py; with the features of `layers` second where asked), or None: eager."""
    graphs = model.graphs
    if graphs is None or (layers and graphs.layers != layers):
        return None
    return graphs.run(x.ids, x.positions, x.view, extra)  # a tree pass takes a tree kind's graph


def at_last(every: torch.Tensor, x: PassInputs, all_logits: bool) -> torch.Tensor:
    """Every-position outputs [B, T, ...] as forward_chunks returns them: [B, longest, ...] when
    all_logits, else each chunk's last [B, ...]."""
    if all_logits:
        return every[:, :x.longest]
    if every.shape[1] == 1:
        return every[:, 0]
    return every[torch.arange(every.shape[0], device=every.device), x.last]


def forward_chunks_features(model: Transformer, pool: CachePool, slots: list[int], chunks: list[list[int]],
                            start_positions: list[int], layers: tuple[int, ...],
                            all_logits: bool = False, trees: list[TokenTree | None] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_chunks' logits, and the features of `layers` at every position [B, longest, F]."""
    x = pass_inputs(model, pool, slots, chunks, start_positions, trees, pack=all_logits)
    replay = replayed(model, x, layers=layers)
    if replay is not None:
        return at_last(replay[0], x, all_logits), replay[1][:, :x.longest]
    logits, features = model.forward_features(x.ids, x.positions, x.view, None if all_logits else x.last, layers,
                                              x.packing)
    return (logits[:, :x.longest] if all_logits else logits), features[:, :x.longest]


def fill_slots(model: Transformer, pool: CachePool, batch: int, context: int) -> list[int]:
    """`batch` new slots of `pool`, each holding `context` tokens' K/V (for timing passes)."""
    slots = [pool.allocate_slot([])[0] for _ in range(batch)]
    forward_chunks(model, pool, slots, [[i % model.shape.vocab_size] * context for i in range(batch)], [0] * batch)
    return slots


def time_pass(model: Transformer, pool: CachePool, slots: list[int], tokens: int, context: int, all_logits: bool) -> float:
    """Seconds for one pass of `tokens` tokens per slot after its `context` keys (every position's
    logits when all_logits, as a verify pass); the slots are rolled back to `context` after."""
    host_sync.wait(model.device)
    t0 = time.perf_counter()
    forward_chunks(model, pool, slots, [[1] * tokens] * len(slots), [context] * len(slots),
                   all_logits=all_logits and tokens > 1)
    host_sync.wait(model.device)
    seconds = time.perf_counter() - t0
    for s in slots:
        pool.truncate_to(s, context)
    return seconds


def pool_for(model: Transformer, max_slots: int, max_seq_len: int, backend: str = "paged", block_size: int = 16,
             num_blocks: int | None = None, prefix_caching: bool = False) -> CachePool:
    """A KV pool shaped for `model` (its layers, heads and dtype)."""
    s = model.shape
    return make_pool(backend, block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                     num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, max_slots=max_slots,
                     max_seq_len=max_seq_len, dtype=model.dtype, device=model.device)
