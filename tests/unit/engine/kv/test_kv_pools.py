"""KV pool bookkeeping: slots, blocks, truncate_to, prefix cache, capacity."""

from __future__ import annotations

import pytest
import torch

from engine.kv import OutOfKVCache, PagedKVPool, make_pool
from engine.kv.protocol import KEY_ALIGN, aligned_key_len


def paged(num_blocks=8, block_size=4, prefix=True, slots=4):
    return PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=2, max_slots=slots, max_seq_len=32,
                       dtype=torch.float32, device="cpu", block_size=block_size, num_blocks=num_blocks,
                       enable_prefix_caching=prefix)


def slotted(slots=2):
    return make_pool("slotted", block_size=4, num_blocks=None, enable_prefix_caching=True, num_layers=1,
                     num_kv_heads=1, head_dim=2, max_slots=slots, max_seq_len=16, dtype=torch.float32, device="cpu")


def write(pool, slot, n, value):
    """Appends n tokens whose K equals `value` and returns the keys the view reads back,
    without the alignment padding (checked in test_gathered_key_lengths_are_aligned_and_masked)."""
    length = pool.seq_len(slot) + n
    view = pool.view([slot], [n])
    k = torch.full((1, n, 1, 2), float(value))
    view.write(0, k, k)
    keys, _ = view.read(0, view.read_rows)
    return keys[:, :, :length]


@pytest.mark.parametrize("make", [paged, slotted])
def test_gathered_key_lengths_are_aligned_and_masked(make):
    """Views over several sequences round L up to KEY_ALIGN; the extra keys are masked."""
    batch = 2
    pool = make()
    slots = [pool.allocate_slot([1])[0] for _ in range(batch)]
    for s, n in zip(slots, [5, 3]):
        pool.view([s], [n]).write(0, torch.ones(1, n, 1, 2), torch.ones(1, n, 1, 2))
    view = pool.view(slots, [1] * len(slots))  # lengths 6 (and 4)
    assert view.key_len == KEY_ALIGN == aligned_key_len(6)
    positions = torch.tensor([[5], [3]])  # [B, 1]
    mask = view.attention_mask(positions)  # [B, 1, 1, L]
    assert mask is not None and mask.shape == (batch, 1, 1, KEY_ALIGN)
    assert mask[0, 0, 0].tolist() == [True] * 6 + [False] * (KEY_ALIGN - 6)
    assert mask[1, 0, 0].tolist() == [True] * 4 + [False] * (KEY_ALIGN - 4)


def test_paged_truncate_frees_exactly_blocks_past_the_new_length():
    pool = paged()
    slot, cached = pool.allocate_slot(list(range(5)))
    assert cached == 0
    write(pool, slot, 10, 1.0)  # 10 tokens -> 3 blocks of 4
    assert pool.num_used_blocks() == 3
    pool.truncate_to(slot, 8)  # exactly 2 full blocks remain
    assert pool.num_used_blocks() == 2 and pool.seq_len(slot) == 8
    pool.truncate_to(slot, 5)  # partial second block is kept
    assert pool.num_used_blocks() == 2
    pool.truncate_to(slot, 4)
    assert pool.num_used_blocks() == 1
    with pytest.raises(ValueError, match="new_len"):
        pool.truncate_to(slot, 7)
    pool.free_slot(slot)
    assert pool.num_used_blocks() == 0 and pool.num_used_slots() == 0



def test_a_rollback_that_keeps_storage_reopens_no_block_and_rewrites_in_place():
    """A speculative round reserves, writes, and is rolled back with keep_storage: the slot keeps
    its blocks, the next round writes over the rejected positions without allocating, reads
    back what it wrote, and free_slot releases everything."""
    pool = paged()
    slot, _ = pool.allocate_slot([1])
    write(pool, slot, 3, 1.0)
    assert pool.ensure_capacity(slot, 3 + 5) and pool.num_used_blocks() == 2  # the round's reservation
    write(pool, slot, 5, 2.0)  # the round's tokens, positions 3..7
    pool.truncate_to(slot, 4, keep_storage=True)  # one accepted: positions 4..7 are rejected
    assert pool.seq_len(slot) == 4 and pool.num_used_blocks() == 2
    blocks = pool.block_table(slot)
    keys = write(pool, slot, 4, 3.0)  # the next round, over the rejected positions
    assert pool.block_table(slot) == blocks
    assert keys[0, 0, :, 0].tolist() == [1.0] * 3 + [2.0] + [3.0] * 4
    pool.truncate_to(slot, 4)  # without keep_storage the block past the length goes
    assert pool.num_used_blocks() == 1
    pool.free_slot(slot)
    assert pool.num_used_blocks() == 0

def test_paged_reads_back_what_was_written_across_blocks():
    pool = paged()
    slot, _ = pool.allocate_slot([1, 2, 3])
    write(pool, slot, 3, 1.0)
    keys = write(pool, slot, 3, 2.0)  # [1, 6, 1, 2]
    assert keys[0, 0, :, 0].tolist() == [1, 1, 1, 2, 2, 2]


def test_paged_sequence_on_consecutive_blocks_reads_a_slice_and_others_gather():
    """One sequence whose blocks follow each other reads its keys as a slice of storage; once
    another sequence's block sits between two of its blocks it gathers them; truncating back
    past that point makes it a slice again. Every read returns what was written."""
    pool = paged(num_blocks=8, block_size=4)
    a, _ = pool.allocate_slot([1])
    b, _ = pool.allocate_slot([1])
    assert write(pool, a, 6, 1.0)[0, 0, :, 0].tolist() == [1.0] * 6  # blocks 0, 1
    assert pool.view([a], [1]).read_rows is None
    pool.truncate_to(a, 6)
    write(pool, b, 2, 5.0)  # block 2
    keys = write(pool, a, 4, 2.0)  # a now holds blocks 0, 1, 3: not one range
    assert pool.block_table(a) == [0, 1, 3]
    assert keys[0, 0, :, 0].tolist() == [1.0] * 6 + [2.0] * 4
    view = pool.view([a], [1])
    assert view.read_rows is not None and view.read_slice is None
    pool.truncate_to(a, 7)  # back to blocks 0, 1
    assert pool.block_table(a) == [0, 1]
    assert pool.view([a], [1]).read_rows is None
    pool.truncate_to(a, 7)
    assert write(pool, a, 1, 3.0)[0, 0, :, 0].tolist() == [1.0] * 6 + [2.0] + [3.0]


def test_a_sequence_grown_in_batches_then_read_alone_reads_what_was_written():
    """Batched views grow slots without building their one-sequence row maps; the first view of
    the slot alone builds it from the blocks the slot holds by then (interleaved, so gathered)."""
    pool = paged(num_blocks=8, block_size=4, prefix=False)
    a, _ = pool.allocate_slot([1])
    b, _ = pool.allocate_slot([1])
    for value in (1.0, 2.0, 3.0):
        view = pool.view([a, b], [2, 2])
        k = torch.full((2, 2, 1, 2), value)
        view.write(0, k, k)
    assert pool.block_table(a) == [0, 2]
    pool.truncate_to(a, 5)
    assert write(pool, a, 2, 4.0)[0, 0, :, 0].tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 4.0, 4.0]


def test_blocks_released_by_a_rollback_are_taken_again_in_order():
    """A sequence cut back by several blocks and extended again gets its blocks back in order,
    so it still reads its keys as one slice."""
    pool = paged(num_blocks=8, block_size=4, prefix=False)
    a, _ = pool.allocate_slot([1])
    write(pool, a, 14, 1.0)
    assert pool.block_table(a) == [0, 1, 2, 3]
    pool.truncate_to(a, 3)
    write(pool, a, 9, 2.0)
    assert pool.block_table(a) == [0, 1, 2]
    assert pool.view([a], [1]).read_rows is None


def test_prefix_cache_reuses_full_blocks_and_never_truncates_them():
    pool = paged(num_blocks=8)
    prompt = list(range(11))  # 2 full blocks + 3 tokens
    a, cached = pool.allocate_slot(prompt)
    assert cached == 0
    write(pool, a, 11, 7.0)
    pool.register_prefix(a, prompt)
    b, cached = pool.allocate_slot(prompt + [99])
    assert cached == 8  # the two full blocks are shared
    assert pool.block_table(b)[:2] == pool.block_table(a)[:2]
    keys = write(pool, b, 4, 3.0)
    assert keys[0, 0, :8, 0].tolist() == [7.0] * 8
    with pytest.raises(ValueError, match="shared prefix"):
        pool.truncate_to(b, 4)
    pool.truncate_to(b, 8)  # the private tail goes, the shared blocks stay
    assert pool.block_table(b) == pool.block_table(a)[:2]
    pool.free_slot(a)
    pool.free_slot(b)
    assert pool.num_used_blocks() == 0
    assert pool.blocks.num_cached() == 2  # still cached, evictable


def test_prefix_cache_token_check_and_exact_match_recomputes_last_token():
    pool = paged(num_blocks=8)
    prompt = list(range(8))  # exactly 2 blocks
    a, _ = pool.allocate_slot(prompt)
    write(pool, a, 8, 1.0)
    pool.register_prefix(a, prompt)
    pool.free_slot(a)
    b, cached = pool.allocate_slot(prompt)
    assert cached == 4  # last block recomputed so the last token has logits
    pool.free_slot(b)
    c, cached = pool.allocate_slot([0, 1, 2, 9] + list(range(4, 9)))
    assert cached == 0  # first block differs -> no reuse of the chain
    pool.free_slot(c)


def test_cached_blocks_are_evicted_lru_when_memory_is_needed():
    pool = paged(num_blocks=4)
    p1, p2 = [1] * 4 + [0], [2] * 4 + [0]
    for p in (p1, p2):
        s, _ = pool.allocate_slot(p)
        write(pool, s, 5, 1.0)
        pool.register_prefix(s, p)
        pool.free_slot(s)
    assert pool.blocks.num_cached() == 2 and pool.blocks.num_available() == 4
    s, _ = pool.allocate_slot([5] * 12)
    write(pool, s, 12, 1.0)  # needs 3 blocks: 2 free + the oldest cached (p1's)
    assert pool.blocks.num_cached() == 1
    pool.free_slot(s)
    _, cached = pool.allocate_slot(p2)
    assert cached == 4


def test_paged_out_of_blocks_allocates_nothing():
    pool = paged(num_blocks=2)
    s, _ = pool.allocate_slot([1])
    write(pool, s, 6, 1.0)
    t, _ = pool.allocate_slot([1])
    with pytest.raises(OutOfKVCache):
        pool.view([s, t], [2, 4])  # needs 2 more blocks, none free
    assert pool.seq_len(s) == 6 and pool.seq_len(t) == 0
    assert not pool.ensure_capacity(t, 1)
    assert pool.free_token_capacity() == 0


def test_slotted_slots_truncate_and_capacity():
    pool = slotted(slots=2)
    a, _ = pool.allocate_slot([1])
    b, _ = pool.allocate_slot([1])
    with pytest.raises(OutOfKVCache):
        pool.allocate_slot([1])
    write(pool, a, 5, 1.0)
    keys = write(pool, a, 2, 2.0)
    assert keys[0, 0, :, 0].tolist() == [1] * 5 + [2] * 2
    pool.truncate_to(a, 3)
    keys = write(pool, a, 1, 4.0)
    assert keys[0, 0, :, 0].tolist() == [1, 1, 1, 4]
    assert not pool.ensure_capacity(a, 17)
    assert pool.free_token_capacity() is None  # a slot holds a whole sequence: no shared limit
    assert pool.view([b], [1]).read_rows is None  # each slot's keys are one slice of storage
    pool.free_slot(a)
    pool.free_slot(b)
    assert pool.num_used_slots() == 0
    with pytest.raises(ValueError):
        pool.free_slot(a)


def test_large_gathers_per_head_read_what_the_single_gather_reads(monkeypatch):
    """Gathers of PER_HEAD_GATHER_ROWS rows or more take one index_select per head; both paths
    must return the same keys and values, laid out [kv_heads, B, L, head_dim]."""
    from engine.kv import protocol

    torch.manual_seed(0)
    batch, length = 8, 300  # B * L = 8 * aligned_key_len(301) = 2,560 rows
    pool = PagedKVPool(num_layers=1, num_kv_heads=2, head_dim=4, max_slots=batch, max_seq_len=320,
                       dtype=torch.float32, device="cpu", block_size=16, num_blocks=8 * 20,
                       enable_prefix_caching=False)
    slots = [pool.allocate_slot([])[0] for _ in range(batch)]
    for s in slots:
        kv = torch.randn(1, length, 2, 4)
        pool.view([s], [length]).write(0, kv, -kv)
    reads = {}
    for threshold in (protocol.PER_HEAD_GATHER_ROWS, 10**9):
        monkeypatch.setattr(protocol, "PER_HEAD_GATHER_ROWS", threshold)
        view = pool.view(slots, [1] * len(slots))
        assert view.read_rows.numel() >= 2048
        new = torch.randn(batch, 1, 2, 4)
        view.write(0, new, -new)
        reads[threshold] = view.read(0, view.read_rows)
        for s in slots:
            pool.truncate_to(s, length)
    (k1, v1), (k2, v2) = reads.values()
    assert k1.shape == (2, batch, aligned_key_len(length + 1), 4)
    assert torch.equal(k1[:, :, :length], k2[:, :, :length]) and torch.equal(v1[:, :, :length], v2[:, :, :length])
    assert torch.equal(v1[:, :, :length], -k1[:, :, :length])


def test_views_over_very_different_lengths_read_keys_in_groups(monkeypatch):
    """20 sequences of 10 tokens and 2 of 300 decoding together: the short ones read 64 keys,
    the long ones 320, instead of all reading 320 (22 * 320 - (20 * 64 + 2 * 320) = 5,120 rows
    spared). Each group's rows are the first L_g columns of the whole batch's."""
    from engine.kv import protocol

    lengths = [10] * 20 + [300] * 2
    pool = PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=2, max_slots=len(lengths), max_seq_len=320,
                       dtype=torch.float32, device="cpu", block_size=16, num_blocks=len(lengths) * 20,
                       enable_prefix_caching=False)
    slots = [pool.allocate_slot([])[0] for _ in lengths]
    for s, n in zip(slots, lengths):
        pool.view([s], [n]).write(0, torch.ones(1, n, 1, 2), torch.ones(1, n, 1, 2))
    view = pool.view(slots, [1] * len(slots))
    assert view.groups is not None
    assert [g.key_len for g in view.groups] == [64, 320]
    assert [g.index.tolist() for g in view.groups] == [list(range(20)), [20, 21]]
    for g in view.groups:
        assert torch.equal(g.read_rows, view.read_rows[g.index, :g.key_len])
    masks = view.attention_groups(torch.tensor([[n] for n in lengths]))  # [B, 1] positions
    assert masks[0].mask.shape == (20, 1, 1, 64) and masks[0].mask[0, 0, 0].sum() == 11
    assert masks[1].mask.shape == (2, 1, 1, 320) and masks[1].mask[0, 0, 0].sum() == 301
    for s, n in zip(slots, lengths):
        pool.truncate_to(s, n)
    # below the threshold of spared rows, one group as before
    monkeypatch.setattr(protocol, "GROUPED_READ_MIN_SAVED_ROWS", 10**9)
    assert pool.view(slots, [1] * len(slots)).groups is None


@pytest.mark.parametrize("verify_width", [1, 4])
def test_grouped_attention_gives_the_logits_of_one_group(tiny_model, monkeypatch, verify_width):
    """The model's output does not depend on whether keys were read in groups (decode and a
    speculative-verify-like pass of several tokens per sequence)."""
    from pathlib import Path

    from engine.config import ModelPlan
    from engine.kv import make_pool, protocol
    from engine.model.loader import load_model
    from engine.model.passes import forward_chunks

    model = load_model(Path(tiny_model[0]), ModelPlan("float32"), "cpu", max_positions=512)
    s = model.shape
    lengths = [5, 7, 150]
    logits = {}
    for threshold in (1, 10**9):
        monkeypatch.setattr(protocol, "GROUPED_READ_MIN_SAVED_ROWS", threshold)
        pool = make_pool("paged", num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                         max_slots=3, max_seq_len=256, dtype=model.dtype, device="cpu", block_size=16,
                         num_blocks=None, enable_prefix_caching=False)
        slots = [pool.allocate_slot([])[0] for _ in lengths]
        for slot, n in zip(slots, lengths):
            forward_chunks(model, pool, [slot], [[(7 * i) % 300 + 3 for i in range(n)]], [0])
        view_groups = pool.view(slots, [verify_width] * 3).groups
        assert (view_groups is not None) == (threshold == 1)
        for slot, n in zip(slots, lengths):
            pool.truncate_to(slot, n)
        chunks = [[11 + j for j in range(verify_width)]] * 3
        logits[threshold] = forward_chunks(model, pool, slots, chunks, lengths, all_logits=True)  # [3, T, V]
    grouped, whole = logits.values()
    torch.testing.assert_close(grouped, whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(grouped.argmax(-1), whole.argmax(-1))
