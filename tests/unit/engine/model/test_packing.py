"""A packed verify pass: rows of different widths in one pass, the linears computing only the
batch's real tokens (counted), with the logits, features and K/V of the padded pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ModelPlan
from engine.model import packing
from engine.model.loader import load_model
from engine.model.passes import computed_tokens, forward_chunks, forward_chunks_features, packs
from tests.helpers import pool_for

CHUNKS = [[5, 9, 2, 17, 3, 8], [7], [21, 6], [40]]  # 10 tokens; padded: 4 x 6 = 24


def counting(model) -> list[int]:
    """Rows each linear of `model`'s passes computes, recorded as they run."""
    rows, linear = [], model._linear

    def counted(x, weight):
        rows.append(x.numel() // x.shape[-1])
        return linear(x, weight)
    model._linear = counted
    return rows


def run(model, backend: str, chunks: list[list[int]], features: bool = False, rows: list[int] | None = None):
    """A verify pass over `chunks` after a 4-token context, then a decode step reading its K/V:
    (logits, the step's logits), or (logits, features); `rows` keeps the verify pass's linears' rows."""
    pool = pool_for(model, backend, block_size=4)
    slots = [pool.allocate_slot([])[0] for _ in chunks]
    forward_chunks(model, pool, slots, [[3, 1, 4, 1]] * len(chunks), [0] * len(chunks))
    if rows is not None:
        rows.clear()
    if features:
        return forward_chunks_features(model, pool, slots, chunks, [4] * len(chunks), (0, 1), all_logits=True)
    logits = forward_chunks(model, pool, slots, chunks, [4] * len(chunks), all_logits=True)
    verify_rows = list(rows) if rows is not None else []
    after = forward_chunks(model, pool, slots, [[11]] * len(chunks), [4 + len(c) for c in chunks])
    if rows is not None:
        rows[:] = verify_rows
    return logits, after


@pytest.fixture
def model(tiny_model):
    return load_model(Path(tiny_model[0]), ModelPlan("float32"), "cpu", max_positions=256)


@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_a_packed_pass_computes_the_batchs_tokens_not_batch_times_the_widest(model, backend, monkeypatch):
    rows = counting(model)
    lengths = [len(c) for c in CHUNKS]
    packed, packed_next = run(model, backend, CHUNKS, rows=rows)
    layers = len(model.layers)
    assert rows == [10] * (4 * layers + 1)  # qkv, o, gate_up and down of each layer, then the LM head
    assert packs(model, lengths) and computed_tokens(model, lengths) == 10
    monkeypatch.setattr(packing, "PACK_BELOW", 0.0)  # the same pass, padded
    padded, padded_next = run(model, backend, CHUNKS, rows=rows)
    assert rows == [24] * (4 * layers + 1)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(packed[i, :n], padded[i, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_next, padded_next, atol=1e-5, rtol=1e-5)  # the K/V written alike


def test_packed_features_equal_the_padded_passs(model, monkeypatch):
    logits, features = run(model, "paged", CHUNKS, features=True)
    monkeypatch.setattr(packing, "PACK_BELOW", 0.0)
    want_logits, want_features = run(model, "paged", CHUNKS, features=True)
    for i, c in enumerate(CHUNKS):
        torch.testing.assert_close(logits[i, :len(c)], want_logits[i, :len(c)], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(features[i, :len(c)], want_features[i, :len(c)], atol=1e-5, rtol=1e-5)


def test_rows_of_one_width_or_little_padding_are_not_packed(model):
    assert not packs(model, [3, 3, 3])
    assert not packs(model, [6, 6, 6, 5])  # 23 of 24: the gathers would cost more than they save
    assert not packs(model, [6])
    assert computed_tokens(model, [6, 6, 6, 5]) == 24
