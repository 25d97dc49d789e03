"""Attention that reads the paged pool in place: FlexAttention over the pool's whole K/V storage with
a block mask that lists each sequence's own blocks, so a decode or verify pass reads every key block
once where the gather (`KVView.read`) reads it, writes a contiguous copy and reads that again.

The block mask is built once per pass, on the device, from what every view has: the storage row of
each key position (`read_rows`: block b's first key at column b * block_size) and the queries'
positions. Its kv_indices are the sequences' block tables, its kv_num_blocks how many blocks reach
the last query; its mask_mod looks each key row's position in its sequence up in a table built
from the batch's read rows (a block two sequences share, a cached prefix or a fork, holds the same
positions in both) and keeps keys at or before the query. One lookup and a comparison, no integer
constant: inductor (torch 2.11, an H200) emitted the engine's block arithmetic `kv_idx // block_size` as
Triton code that does not compile, and a lookup inside a lookup as C++ that does not (CPU). On
CUDA flex_attention is compiled (one kernel over a dynamic batch); on CPU it runs eager (a dense
reference over the pool, each sequence's own rows checked densely: correct, slow; tests only).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from engine.kv.protocol import KVView
from engine.model.probe import compare_on_probe

log = logging.getLogger(__name__)

Q_BLOCK = 128  # query rows per block of the mask: a decode or verify pass is one block


def inplace_on(setting: str, device: str) -> bool:
    """EngineConfig.paged_attention: only "inplace" reads in place (eager on CPU: tests). "auto" gathers:
    on an H200 in place ran 0.29-0.64x the gather (docs/gpu.md), its passes outside the CUDA graphs."""
    return setting == "inplace"


class PagedMask(NamedTuple):
    """One pass's block mask over the pool (the same for every layer), as tensors."""

    kv_num_blocks: torch.Tensor  # [B, 1, q_blocks] blocks of each sequence up to its last query
    kv_indices: torch.Tensor  # [B, 1, q_blocks, num_blocks] its physical blocks, in order, first
    row_position: torch.Tensor  # [rows + 1] each storage row's position in the sequence holding it (NOT_HELD: none)
    positions: torch.Tensor  # [B, T] the queries' positions


NOT_HELD = 1 << 30  # row_position of a row no sequence of the pass holds: past every query's position


def paged_flex(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_num_blocks: torch.Tensor,
               kv_indices: torch.Tensor, row_position: torch.Tensor, positions: torch.Tensor, block_size: int,
               scale: float) -> torch.Tensor:
    """flex_attention of q [B, heads, T, D] over the pool's keys, values [1, kv_heads, rows, D] under
    the pass's block mask. The mask_mod is made here from tensor arguments, so a compiled call is
    traced once, not once per engine or per pass (a new closure each time would be re-traced until
    dynamo's recompile limit, after which it runs the unfused reference: the whole pool's scores)."""

    if torch.compiler.is_compiling():  # the kernels visit only each sequence's listed blocks
        def visible(b, h, q_idx, kv_idx):  # key row kv_idx (one of b's blocks) is at or before query q_idx
            return row_position[kv_idx] <= positions[b, q_idx]
    else:  # eager flex_attention applies the mask_mod to every key of the pool: each sequence's own, densely
        owned = _owned_rows(kv_num_blocks, kv_indices, block_size, keys.shape[2] // block_size)  # [B, rows]

        def visible(b, h, q_idx, kv_idx):
            return owned[b, kv_idx] & (row_position[kv_idx] <= positions[b, q_idx])
    mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=visible,
                                    seq_lengths=(q.shape[2], keys.shape[2]), compute_q_blocks=False)
    return flex_attention(q, keys, values, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1],
                          kernel_options=kernel_options(block_size) if q.is_cuda else None)


def _owned_rows(kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, block_size: int, pool_blocks: int) -> torch.Tensor:
    """[B, rows] whether each storage row lies in one of the blocks the mask lists for sequence b."""
    B, columns = kv_indices.shape[0], kv_indices.shape[-1]
    device = kv_indices.device
    listed = torch.arange(columns, device=device)[None] < kv_num_blocks[:, 0, 0, None]  # [B, columns] in use
    owned = torch.zeros(B, pool_blocks, dtype=torch.bool, device=device)  # [B, pool blocks] by physical block
    rows = torch.arange(B, device=device)[:, None].expand(B, columns)
    owned[rows[listed], kv_indices[:, 0, 0].long()[listed]] = True
    return owned.repeat_interleave(block_size, dim=1)


def kernel_options(block_size: int) -> dict:
    """The Triton kernel's key tile: it must divide a pool block (its default, 64 or 128 keys, is
    wider than a 16-token block, and inductor then finds no kernel)."""
    tile = next((n for n in (64, 32, 16) if block_size % n == 0), None)
    if tile is None:
        raise ValueError(f"reading in place on CUDA needs a block_size that is a multiple of 16, not {block_size}")
    return {"BLOCK_N": tile}


class PagedAttention:
    """In-place attention over one pool's storage [layers, 2, kv_heads, rows + 1, head_dim]."""

    def __init__(self, storage: torch.Tensor, block_size: int, max_queries: int, flex: Callable | None = None,
                 pool_columns: bool | None = None):
        """flex(scale): paged_flex for that softmax scale, or a compiled form of it (None: compiled
        on CUDA, eager elsewhere).
        pool_columns: the block mask has a column per block of the pool, not per block a pass's
        keys span (None: on CPU, where inductor's kernel asserts it; on CUDA the mask would grow
        with max_batch_size squared)."""
        self.storage = storage  # the pool's [layers, 2, kv_heads, rows + 1, head_dim]
        self.block_size = block_size
        self.num_blocks = (storage.shape[3] - 1) // block_size
        self.max_queries = max_queries  # passes of at most this many queries a sequence read in place (decode, verify)
        self.pool_columns = storage.device.type == "cpu" if pool_columns is None else pool_columns
        self._flex = flex or (functools.partial(_compiled_flex, block_size) if storage.device.type == "cuda"
                              else lambda scale: paged_flex)

    def takes(self, queries: int, view: KVView) -> bool:
        """Whether a pass of `queries` tokens a sequence over `view` reads in place (else it gathers)."""
        return queries <= self.max_queries and view.storage is self.storage and view.mask_override is None \
            and (view.read_rows is not None or view.read_slice is not None)

    def mask(self, view: KVView, positions: torch.Tensor) -> PagedMask:
        """The pass's block mask; positions [B, T] (padded queries: position 0)."""
        bs, nb = self.block_size, self.num_blocks
        B, T = positions.shape
        device = positions.device
        if view.read_rows is not None:
            first_rows = view.read_rows[:, ::bs]  # [B, M] each key block's first storage row
        else:  # one sequence over consecutive rows
            first_rows = torch.arange(view.read_slice.start, view.read_slice.stop, bs, device=device)[None]
        table = first_rows // bs  # [B, M] physical blocks (nb: the scratch row's, a padded key)
        M = table.shape[1]
        rows = nb * bs  # the scratch row (a padded key) is row `rows`
        row_position = torch.full((rows + 1,), NOT_HELD, dtype=torch.int32, device=device)  # [rows + 1]
        if view.read_rows is not None:
            L = view.read_rows.shape[1]
            keys = torch.arange(L, device=device, dtype=torch.int32).expand(B, L)  # [B, L]
            row_position.scatter_(0, view.read_rows.reshape(-1), keys.reshape(-1))
        else:
            row_position[view.read_slice] = torch.arange(view.read_slice.stop - view.read_slice.start, device=device,
                                                         dtype=torch.int32)
        row_position[rows:].fill_(NOT_HELD)  # padded keys wrote the scratch row's; fill_: no host scalar copied over
        counts = (positions.amax(dim=1) // bs + 1).clamp(max=M).to(torch.int32)  # [B] blocks up to the last query
        q_blocks = -(-T // Q_BLOCK)
        kv_num_blocks = counts[:, None, None].expand(B, 1, q_blocks).contiguous()  # [B, 1, q_blocks]
        # a column per block the pass's keys span (its key bucket), or per block of the pool, its own first
        columns = nb if self.pool_columns else M
        kv_indices = torch.zeros(B, 1, q_blocks, columns, dtype=torch.int32, device=device)  # [B, 1, q_blocks, columns]
        kv_indices[..., :min(M, columns)] = table[:, None, None, :columns].clamp(max=nb - 1).to(torch.int32)
        return PagedMask(kv_num_blocks, kv_indices, row_position, positions)

    def attend(self, q: torch.Tensor, kv: torch.Tensor, mask: PagedMask, scale: float) -> torch.Tensor:
        """q [B, heads, T, D] over one layer's pool kv [2, kv_heads, rows + 1, D] -> [B, heads, T, D]."""
        rows = self.num_blocks * self.block_size  # the scratch row past them is never a key
        keys, values = kv[0, :, :rows].unsqueeze(0), kv[1, :, :rows].unsqueeze(0)  # [1, kv_heads, rows, D]
        return self._flex(scale)(q, keys, values, *mask, self.block_size, scale)


@functools.cache
def _compiled_flex(block_size: int, scale: float) -> Callable:
    """paged_flex compiled once per process, block size and softmax scale, with dynamic shapes: a
    pass's batch and width change every step, and a kernel per shape would soon pass dynamo's
    recompile limit. The block size (the kernel's key tile) and the scale are constants of the
    trace, not arguments a dynamic trace would make symbolic."""
    def flex(q, keys, values, kv_num_blocks, kv_indices, row_position, positions, _block_size, _scale):
        return paged_flex(q, keys, values, kv_num_blocks, kv_indices, row_position, positions, block_size, scale)
    return torch.compile(flex, dynamic=True)


def check_inplace(model, pool, tolerance: float) -> str | None:
    """Compares the model's passes reading in place with the gather on a probe over `pool`
    (ragged decode and verify batches, one sequence alone); what differs, or None."""
    if pool.storage.is_cuda:
        kernel_options(pool.block_size)  # a block the kernel cannot tile raises, with why
    paged = model.paged

    def switch(on: bool) -> None:
        model.paged = paged if on else None
    problem = compare_on_probe(model, pool, switch, tolerance)
    return None if problem is None else f"in place differs from the gather {problem}"
