"""Attention reading the paged pool in place (engine/model/paged_attention.py, FlexAttention eager on
CPU) against the gather and a float64 reference: decode, verify and ragged batches over scattered
blocks, one sequence over consecutive blocks, GQA and MHA; the engine's load-time check, its
fallback to the gather, and greedy output with it on."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.config import EngineConfig
from engine.kv import PagedKVPool
from engine.model.paged_attention import PagedAttention, _compiled_flex, inplace_on, kernel_options
from tests.helpers import greedy

D = 8


def _pool(kv_heads: int, block_size: int = 4) -> PagedKVPool:
    return PagedKVPool(num_layers=1, num_kv_heads=kv_heads, head_dim=D, max_slots=4, max_seq_len=64,
                       dtype=torch.float32, device="cpu", block_size=block_size, num_blocks=40)


def _append(pool, slots, chunks, logical, generator):
    """Writes random K/V for chunks[i] new tokens of slots[i] (recorded in logical[slot] as [n, heads, D]
    float64); returns the view and its positions [B, T]."""
    T = max(chunks)
    view = pool.view(slots, chunks, width=T, tokens=[[0] * T for _ in slots])
    heads = pool.storage.shape[2]
    k = torch.randn(len(slots), T, heads, D, generator=generator)
    v = torch.randn(len(slots), T, heads, D, generator=generator)
    view.write(0, k, v)
    for i, (s, c) in enumerate(zip(slots, chunks)):
        keys, values = logical.setdefault(s, (torch.zeros(0, heads, D, dtype=torch.float64),) * 2)
        logical[s] = (torch.cat([keys, k[i, :c].double()]), torch.cat([values, v[i, :c].double()]))
    return view, view.position_ids


def _reference(q, slots, chunks, logical, positions):
    """Float64 attention of each real query over its sequence's keys at positions <= its own."""
    B, H, T, _ = q.shape
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b, (s, c) in enumerate(zip(slots, chunks)):
        keys, values = logical[s]  # [n, kv_heads, D]
        group = H // keys.shape[1]
        for t in range(c):
            n = int(positions[b, t]) + 1
            k = keys[:n].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
            v = values[:n].repeat_interleave(group, dim=1).transpose(0, 1)
            scores = (q[b, :, t:t + 1].double() @ k.transpose(-1, -2)) * D ** -0.5  # [H, 1, n]
            out[b, :, t] = (scores.softmax(-1) @ v)[:, 0]
    return out


def _gather(q, view, positions):
    """The gather path: each sequence's keys copied out, SDPA under the view's causal mask."""
    keys, values = view.read(0, view.read_rows)  # [kv_heads, B, L, D] (read_slice for one sequence)
    mask = view.attention_mask(positions)
    return F.scaled_dot_product_attention(q, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
                                          scale=D ** -0.5, enable_gqa=q.shape[1] != keys.shape[0])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_in_place_equals_the_gather_and_a_float64_reference(heads, kv_heads):
    generator = torch.Generator().manual_seed(0)
    pool = _pool(kv_heads)
    paged = PagedAttention(pool.storage, pool.block_size, max_queries=16)
    slots = [pool.allocate_slot([])[0] for _ in range(3)]
    logical = {}
    for step in range(4):  # interleaved growth: each sequence's blocks are scattered over the pool
        _append(pool, slots, [3 + step, 1 + 2 * step, 2], logical, generator)
    assert all(pool.block_table(s) != list(range(pool.block_table(s)[0], pool.block_table(s)[0] + 4))
               for s in slots)
    lone = pool.allocate_slot([])[0]  # one sequence over consecutive blocks: the view reads a slice
    _append(pool, [lone], [9], logical, generator)
    cases = [(slots, [1, 1, 1]),  # ragged decode
             (slots, [4, 2, 3]),  # ragged verify, padded queries
             (slots[:2], [5, 5]),  # verify, equal chunks
             ([slots[1]], [1]),  # one scattered sequence
             ([lone], [1]), ([lone], [3])]  # consecutive blocks: read_slice
    for rows, chunks in cases:
        view, positions = _append(pool, rows, chunks, logical, generator)
        q = torch.randn(len(rows), heads, max(chunks), D, generator=generator)
        got = paged.attend(q, pool.storage[0], paged.mask(view, positions), D ** -0.5)
        gathered = _gather(q, view, positions)
        want = _reference(q, rows, chunks, logical, positions)
        for b, c in enumerate(chunks):
            torch.testing.assert_close(got[b, :, :c].double(), want[b, :, :c], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gathered[b, :, :c].double(), want[b, :, :c], rtol=1e-5, atol=1e-5)
        for s, c in zip(rows, chunks):  # verify: roll back part of it, as a rejected proposal would
            keep = pool.seq_len(s) - (c - 1)
            pool.truncate_to(s, keep)
            logical[s] = tuple(t[:keep] for t in logical[s])


def test_compiled_flex_attention_reads_in_place_as_the_eager_one():
    """The block mask and its mask_mod through torch.compile (inductor's CPU kernel; CUDA compiles
    to Triton): a decode and a ragged verify pass over scattered blocks; a second PagedAttention
    (another engine) reuses the traced function."""
    generator = torch.Generator().manual_seed(1)
    pool = _pool(kv_heads=2, block_size=16)
    eager = PagedAttention(pool.storage, 16, max_queries=16)
    compiled = PagedAttention(pool.storage, 16, max_queries=16, flex=lambda scale: _compiled_flex(16, scale))  # the engine's, on CUDA
    slots = [pool.allocate_slot([])[0] for _ in range(3)]
    logical = {}
    for chunks in ([20, 5, 33], [9, 17, 1]):
        _append(pool, slots, chunks, logical, generator)
    for chunks in ([1, 1, 1], [4, 2, 3]):
        view, positions = _append(pool, slots, chunks, logical, generator)
        q = torch.randn(3, 4, max(chunks), D, generator=generator)
        want = eager.attend(q, pool.storage[0], eager.mask(view, positions), D ** -0.5)
        got = compiled.attend(q, pool.storage[0], compiled.mask(view, positions), D ** -0.5)
        for b, c in enumerate(chunks):
            torch.testing.assert_close(got[b, :, :c], want[b, :, :c], rtol=1e-5, atol=1e-5)


def test_the_setting_is_validated_and_auto_gathers(tiny_model):
    with pytest.raises(ValueError, match="paged_attention"):
        EngineConfig(paged_attention="flash")
    assert inplace_on("inplace", "cpu") and inplace_on("inplace", "cuda") and not inplace_on("auto", "cpu")
    assert not inplace_on("auto", "cuda")  # measured slower than the gather on an H200
    assert not inplace_on("gather", "cuda:1")
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=64, max_batch_size=4)  # the CPU default
    assert llm.engine.paged_attention == {} and llm.engine.model.paged is None


COMMON = dict(dtype="float32", max_seq_len=48, max_batch_size=3, block_size=4, forward_plan="torch")
PROMPTS = ["def add(a, b):\n    return a + b\n", "import os", "class Point:\n"]



def test_greedy_output_in_place_equals_the_gather_plain_and_speculative(tiny_model, tiny_draft):
    want = [o.token_ids for o in LLM(model=str(tiny_model[0]), **COMMON).generate(PROMPTS, greedy(10))]
    plain = LLM(model=str(tiny_model[0]), paged_attention="inplace", **COMMON)
    assert plain.engine.paged_attention == {"target": "inplace"}
    assert [o.token_ids for o in plain.generate(PROMPTS, greedy(10))] == want
    assert plain.engine.model.last_attention_branches == ("inplace",)
    spec = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
               spec_policy="fixed", spec_length=3, paged_attention="inplace", **COMMON)
    assert spec.engine.paged_attention == {"target": "inplace", "draft": "inplace"}
    outs = spec.generate(PROMPTS, greedy(10))
    assert [o.token_ids for o in outs] == want and sum(o.num_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("fault", ["raises", "differs"])
def test_an_in_place_kernel_that_fails_or_differs_leaves_the_gather(tiny_model, monkeypatch, caplog, fault):
    def broken(self, q, kv, mask, scale):
        if fault == "raises":
            raise RuntimeError("no kernel for these inputs")
        return torch.zeros_like(q)
    monkeypatch.setattr(PagedAttention, "attend", broken)
    with caplog.at_level(logging.WARNING, logger="engine.startup"):
        llm = LLM(model=str(tiny_model[0]), paged_attention="inplace", **COMMON)
    why = llm.engine.paged_attention["target"]
    assert why.startswith("gather: ") and ("no kernel" if fault == "raises" else "differs") in why
    assert llm.engine.model.paged is None
    assert any("gathers its keys" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert llm.generate(PROMPTS[0], greedy(10))[0].token_ids  # runs, gathering


def test_the_kernel_tile_divides_the_pool_block_or_the_pool_is_refused():
    # the Triton kernel's default key tile (64 or 128) finds no kernel over 16-token blocks (seen on an H200)
    assert kernel_options(16) == {"BLOCK_N": 16}
    assert kernel_options(48) == {"BLOCK_N": 16}
    assert kernel_options(2048) == {"BLOCK_N": 64}
    with pytest.raises(ValueError, match="block_size that is a multiple of 16, not 2124"):
        kernel_options(2124)  # a slotted pool's one block of max_seq_len tokens


def test_the_mask_makes_no_tensor_of_a_python_number_and_spans_only_the_passes_blocks():
    """Built on the meta device (standing in for CUDA): no op makes a tensor of a Python number, as
    `row_position[rows] = NOT_HELD` did (a scalar tensor allocated and copied every pass, inside
    graph capture too). With pool_columns off (CUDA's default) the block mask has a column per
    block the keys span, not per block of the pool: its size no longer grows with max_batch_size
    squared."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.scalar_tensor.default, torch.ops.aten.lift_fresh.default):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    block, pool_blocks, keys = 4, 64, 12  # a pass over 3 blocks of a 64-block pool
    storage = torch.empty(1, 2, 2, pool_blocks * block + 1, D, device="meta")
    paged = PagedAttention(storage, block, max_queries=16, flex=lambda scale: None, pool_columns=False)
    view = SimpleNamespace(read_rows=torch.zeros(2, keys, dtype=torch.long, device="meta"), read_slice=None)
    positions = torch.zeros(2, 3, dtype=torch.long, device="meta")
    with ScalarTensors() as mode:
        mask = paged.mask(view, positions)
    assert mode.seen == []
    assert mask.kv_indices.shape == (2, 1, 1, keys // block)
    assert PagedAttention(storage, block, 16, flex=lambda scale: None, pool_columns=True).mask(
        view, positions).kv_indices.shape[-1] == pool_blocks


@pytest.mark.parametrize("pool_columns", [False, True])
def test_in_place_is_exact_with_either_column_layout(pool_columns):
    generator = torch.Generator().manual_seed(3)
    pool = _pool(kv_heads=2)
    paged = PagedAttention(pool.storage, pool.block_size, max_queries=16, pool_columns=pool_columns)
    slots = [pool.allocate_slot([])[0] for _ in range(3)]
    logical = {}
    for step in range(3):
        _append(pool, slots, [2 + step, 5, 1 + step], logical, generator)
    view, positions = _append(pool, slots, [3, 1, 2], logical, generator)
    q = torch.randn(3, 4, 3, D, generator=generator)
    got = paged.attend(q, pool.storage[0], paged.mask(view, positions), D ** -0.5)
    want = _reference(q, slots, [3, 1, 2], logical, positions)
    for b, c in enumerate([3, 1, 2]):
        torch.testing.assert_close(got[b, :, :c].double(), want[b, :, :c], rtol=1e-5, atol=1e-5)
