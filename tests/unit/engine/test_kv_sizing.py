"""The activation reserve the KV pools leave free (engine/kv/sizing.py `activation_bytes`): it grows
with the batch, the proposals per round and the vocabulary, the pools sized from free memory get
fewer blocks by it, and memory too small once it is kept says so."""

from __future__ import annotations

import dataclasses

import pytest

from engine.kv_sizing import activation_bytes, kv_bytes_per_token, pool_blocks
from engine.model.rope import Rope
from engine.model.shape import ModelShape


def shape(vocab: int = 128256, hidden: int = 4096, intermediate: int = 14336, layers: int = 32,
          heads: int = 32, kv_heads: int = 8) -> ModelShape:
    """A Llama-3-8B-like shape by default."""
    head_dim = hidden // heads
    rope = Rope.from_hf_config({"rope_theta": 500000.0}, head_dim)
    return ModelShape(vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, 1e-5, rope, 8192, False)


TARGET, DRAFT = shape(), shape(hidden=2048, intermediate=8192, layers=16)


def reserve(batch: int = 64, k: int = 8, target: ModelShape = TARGET, draft: ModelShape = DRAFT,
            tokens: int = 512, seq: int = 8192) -> int:
    return activation_bytes([target, draft], [2, 2], batch, k, tokens, seq)


def test_the_reserve_grows_with_batch_proposals_and_vocabulary():
    assert reserve(batch=8) < reserve(batch=32) < reserve(batch=64)
    assert reserve(k=0) < reserve(k=4) < reserve(k=8)
    big = dataclasses.replace(TARGET, vocab_size=2 * TARGET.vocab_size)
    assert reserve() < reserve(target=big, draft=dataclasses.replace(DRAFT, vocab_size=big.vocab_size))
    # a verify at batch 64, K = 8, 128k vocabulary: its logits and probabilities alone take ~1.5 GB
    assert 1.5e9 < reserve() < 10e9
    # a wide prefill chunk outgrows a small verify
    assert reserve(batch=1, k=0, tokens=8192) > reserve(batch=1, k=0, tokens=512)


def test_pools_get_fewer_blocks_by_the_reserve():
    per_token = kv_bytes_per_token([TARGET, DRAFT], [2, 2])
    block_bytes = 16 * per_token
    free, kept = 60 * 2**30, reserve()
    before = pool_blocks(free, 0.9, per_token, 16, 256, 8192, paged=True)
    after = pool_blocks(free, 0.9, per_token, 16, 256, 8192, paged=True, reserve_bytes=kept)
    assert after == int(0.9 * (free - kept)) // block_bytes
    assert before - after == pytest.approx(0.9 * kept / block_bytes, abs=1)


def test_memory_that_holds_no_sequence_once_the_reserve_is_kept_is_an_error_naming_it():
    per_token = kv_bytes_per_token([TARGET, DRAFT], [2, 2])
    one_sequence = 8192 * per_token
    assert pool_blocks(one_sequence, 1.0, per_token, 16, 64, 8192, paged=True) == 512
    with pytest.raises(ValueError, match=r"less an activation reserve of [0-9.]+ GiB.*one sequence of max_seq_len 8192"
                                         r".*activation reserve shrinks with max_batch_size, spec_length"):
        pool_blocks(one_sequence, 1.0, per_token, 16, 64, 8192, paged=True, reserve_bytes=reserve())


def test_an_engine_sizes_its_pools_after_the_reserve(tiny_model, tiny_draft):
    """With the free-memory probe injected: the reserve of the config's largest pass comes off the
    free memory before the fraction; a smaller max_batch_size or spec_length leaves more blocks."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.model.loader import read_shape

    target, draft = read_shape(tiny_model[0]), read_shape(tiny_draft[0])
    per_token = kv_bytes_per_token([target, draft], [4, 4])
    free = 40 * 16 * per_token + activation_bytes([target, draft], [4, 4], 64, 8, 512, 256)

    def blocks(**kw) -> int:
        config = EngineConfig.from_kwargs(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]),
                                          use_speculative_decoding=True, spec_policy="fixed", dtype="float32",
                                          max_seq_len=256, block_size=16, forward_plan="torch",
                                          kv_cache_memory_fraction=1.0, **kw)
        return LLMEngine(config, free_memory=lambda device: free).config.num_kv_blocks

    assert blocks(max_batch_size=64, spec_length=8) == 40
    assert blocks(max_batch_size=32, spec_length=8) > 40
    assert blocks(max_batch_size=64, spec_length=2) > 40
