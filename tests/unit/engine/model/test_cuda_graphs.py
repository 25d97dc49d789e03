"""Captured passes (engine/model/cuda_graphs.py) under the CPU emulation: a replay over the static
buffers equals eager (padded buckets, key buckets, a pass beyond the largest bucket stays eager),
the static inputs are the same tensors every replay, a capture that raises or a replay that
differs leaves the model eager with a warning, and greedy speculation with graphs on equals
plain greedy."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM
from engine.config import EngineConfig, ModelPlan
from engine.engine import LLMEngine
from engine.model.cuda_graphs import (
    CapturedPasses,
    EmulatedCapture,
    PassKind,
    batch_buckets,
    graphs_on,
    key_buckets,
    target_pass,
)
from engine.model.loader import load_model
from engine.model.passes import forward_chunks, pool_for
from engine.token_tree import TokenTree
from tests.helpers import greedy

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "class Point:\n    def __init__(self, x, y):",
           "import os", "x", "for i in range(10):\n    print(i * i)\n"]
COMMON = dict(dtype="float32", max_seq_len=160, max_batch_size=4, forward_plan="torch")



@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(model=str(tiny_model[0]), **COMMON)
    return [o.token_ids for o in llm.generate(PROMPTS, greedy(16))]


def test_the_setting_is_validated_and_auto_captures_on_cuda_only(tiny_model):
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    assert graphs_on("auto", "cuda:0") and graphs_on("on", "cpu") and graphs_on("on", "cuda")
    assert not graphs_on("auto", "cpu") and not graphs_on("off", "cuda")
    llm = LLM(model=str(tiny_model[0]), **COMMON)  # the default on CPU: nothing captured
    assert llm.engine.cuda_graphs == {} and llm.engine.model.graphs is None
    assert batch_buckets(6) == [1, 2, 4, 6] and batch_buckets(1) == [1] and batch_buckets(8) == [1, 2, 4, 8]
    assert key_buckets(160) == [192] and key_buckets(1000) == [256, 512, 1024]


@pytest.fixture
def model_and_pool(tiny_model):
    model = load_model(tiny_model[0], ModelPlan("float32"), "cpu", 512)
    return model, pool_for(model, max_slots=8, max_seq_len=400, block_size=4)


def _pass(model, pool, slots, chunks, all_logits, graphs, trees=None):
    """forward_chunks with `graphs` on the model (None: eager); the slots rolled back after."""
    starts = [pool.seq_len(s) for s in slots]
    model.graphs = graphs
    try:
        return forward_chunks(model, pool, slots, chunks, starts, all_logits=all_logits, trees=trees)
    finally:
        model.graphs = None
        for s, n in zip(slots, starts):
            pool.truncate_to(s, n)


def test_a_replay_over_the_static_buffers_equals_eager_padded_or_beyond_the_buckets(model_and_pool):
    model, pool = model_and_pool
    graphs = CapturedPasses(target_pass(model, ()), pool.storage, [PassKind(1), PassKind(5)], max_batch=4,
                            max_seq_len=400, extra_dtype=model.dtype)
    assert graphs.keys == [256, 448] and graphs.batches == [1, 2, 4]
    assert graphs.capture(EmulatedCapture()) == 2 * 3 * 2
    contexts = [3, 17, 40, 9, 300, 5]  # ragged; one past the first key bucket
    slots = [pool.allocate_slot([])[0] for _ in contexts]
    vocab = model.shape.vocab_size
    forward_chunks(model, pool, slots, [[(7 * i + j) % vocab for j in range(n)] for i, n in enumerate(contexts)],
                   [0] * len(slots))
    cases = [([0], [[5]], False), ([1], [[5, 6, 7]], True),  # one sequence: decode, verify
             ([0, 1, 2], [[1], [2], [3]], False),  # pads to bucket 4
             ([0, 1, 2, 3], [[1, 2], [3, 4, 5, 6, 7], [8], [9, 10, 11]], True),  # a ragged verify, width 5
             ([1, 4], [[1], [2]], False),  # the long context: key bucket 448
             ([0, 1, 2, 3, 4, 5], [[1]] * 6, False),  # beyond the largest bucket: eager
             ([0, 1], [[1] * 6, [2] * 6], True)]  # wider than every kind: eager
    replays = 0
    for rows, chunks, all_logits in cases:
        picked = [slots[r] for r in rows]
        eager = _pass(model, pool, picked, chunks, all_logits, None)
        replayed = _pass(model, pool, picked, chunks, all_logits, graphs)
        fits = len(rows) <= 4 and max(len(c) for c in chunks) <= 5
        replays += fits
        assert graphs.replays == replays, (rows, chunks)
        assert replayed.shape == eager.shape
        if all_logits:  # a row's positions past its chunk are padding in both
            for i, c in enumerate(chunks):
                torch.testing.assert_close(replayed[i, :len(c)], eager[i, :len(c)], rtol=1e-5, atol=1e-5)
                assert torch.equal(replayed[i, :len(c)].argmax(-1), eager[i, :len(c)].argmax(-1))
        else:
            torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
            assert torch.equal(replayed.argmax(-1), eager.argmax(-1))


def test_a_tree_pass_replays_a_tree_kind_under_its_own_mask(model_and_pool):
    model, pool = model_and_pool
    graphs = CapturedPasses(target_pass(model, ()), pool.storage, [PassKind(1), PassKind(5), PassKind(8, tree=True)],
                            max_batch=4, max_seq_len=400, extra_dtype=model.dtype)
    graphs.capture(EmulatedCapture())
    contexts = [3, 17, 40]
    slots = [pool.allocate_slot([])[0] for _ in contexts]
    vocab = model.shape.vocab_size
    forward_chunks(model, pool, slots, [[(5 * i + j) % vocab for j in range(n)] for i, n in enumerate(contexts)],
                   [0] * len(slots))
    bushy = TokenTree((11, 12, 13, 14, 15, 16), (-1, -1, -1, 0, 0, 1))  # three children at the root
    chain = TokenTree((21, 22, 23), (-1, 0, 1))
    cases = [([0], [[7, *bushy.tokens]], [bushy]),
             ([0, 1, 2], [[7, *bushy.tokens], [8, *chain.tokens], [9]], [bushy, chain, None]),  # ragged, pads to 4
             ([1, 2], [[4, 5, 6], [7, *bushy.tokens]], [None, bushy])]
    for rows, chunks, trees in cases:
        picked = [slots[r] for r in rows]
        before = graphs.tree_replays
        eager = _pass(model, pool, picked, chunks, True, None, trees)
        replayed = _pass(model, pool, picked, chunks, True, graphs, trees)
        assert graphs.tree_replays == before + 1
        for i, c in enumerate(chunks):
            torch.testing.assert_close(replayed[i, :len(c)], eager[i, :len(c)], rtol=1e-5, atol=1e-5)
        # the mask matters: the same tokens as a chain give other logits where a node is not its predecessor's child
        as_chain = _pass(model, pool, picked, chunks, True, None, None)
        i = trees.index(bushy)
        assert not torch.allclose(as_chain[i, :len(chunks[i])], eager[i, :len(chunks[i])], atol=1e-4)
    chains = graphs.replays
    _pass(model, pool, [slots[0]], [[1, 2, 3]], True, graphs, None)  # a chain takes a chain kind
    assert graphs.replays == chains + 1 and graphs.tree_replays == len(cases)
    wide = TokenTree(tuple(range(30, 39)), (-1,) * 9)
    _pass(model, pool, [slots[0]], [[7, *wide.tokens]], True, graphs, [wide])  # wider than the tree kind: eager
    assert graphs.replays == chains + 1


def test_the_static_inputs_are_the_same_tensors_every_replay_filled_in_place(model_and_pool):
    model, pool = model_and_pool
    seen = []  # the storage each captured pass read its inputs from
    fn = target_pass(model, ())

    def recording(ids, positions, view, extra):
        seen.append(tuple(t.untyped_storage().data_ptr() for t in (ids, positions, view.write_rows, view.read_rows)))
        return fn(ids, positions, view, extra)
    graphs = CapturedPasses(recording, pool.storage, [PassKind(1)], max_batch=2, max_seq_len=400,
                            extra_dtype=model.dtype)
    graphs.capture(EmulatedCapture())
    static = graphs._static[PassKind(1)]
    buffers = (static.ids, static.positions, static.write_rows, static.read_rows)
    pointers = tuple(t.untyped_storage().data_ptr() for t in buffers)
    slots = [pool.allocate_slot([])[0] for _ in range(2)]
    forward_chunks(model, pool, slots, [[1, 2, 3], [4, 5]], [0, 0])
    seen.clear()
    model.graphs = graphs
    for step, token in enumerate([7, 8, 9]):
        rows = slots[:1] if step == 1 else slots
        forward_chunks(model, pool, rows, [[token]] * len(rows), [pool.seq_len(s) for s in rows])
        assert static.ids[0, 0].item() == token  # this step's input, copied into the static buffer
        assert static.positions[0, 0].item() == pool.seq_len(slots[0]) - 1
    model.graphs = None
    assert len(seen) == 3 and set(seen) == {pointers}
    assert graphs._static[PassKind(1)] is static and all(a is b for a, b in zip(
        (static.ids, static.positions, static.write_rows, static.read_rows), buffers))


class RaisingCapture:
    def __call__(self, body):
        raise RuntimeError("operation not permitted when stream is capturing")


class StaleCapture:
    """A replay that runs nothing: the static outputs keep what the last run left."""

    def __call__(self, body):
        body()
        return lambda: None


@pytest.mark.parametrize("capture,why", [(RaisingCapture(), "capture failed"), (StaleCapture(), "differs")])
def test_a_capture_that_raises_or_a_replay_that_differs_leaves_the_model_eager(tiny_model, tiny_draft, reference,
                                                                                caplog, capture, why):
    config = EngineConfig.from_kwargs(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]),
                                      use_speculative_decoding=True, spec_policy="fixed", spec_length=3,
                                      cuda_graphs="on", **COMMON)
    with caplog.at_level(logging.WARNING, logger="engine.model.cuda_graphs"):
        engine = LLMEngine(config, graph_capture=capture)
    assert set(engine.cuda_graphs) == {"target", "draft"}
    for role, report in engine.cuda_graphs.items():
        assert report.graphs == 0 and why in report.fallback, role
    assert engine.model.graphs is None and engine.draft_model.graphs is None
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "runs eager" in r.getMessage()]
    assert len(warned) == 2 and all(why in r.getMessage() for r in warned)
    llm = LLM.__new__(LLM)
    llm.config, llm.engine = config, engine
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(16))] == reference


class CaptureMarking:
    """The emulation, with `capturing` set while a body is recorded."""

    capturing = False

    def __call__(self, body):
        CaptureMarking.capturing = True
        try:
            body()
        finally:
            CaptureMarking.capturing = False
        return body


def test_a_capture_that_fails_in_place_keeps_the_graphs_and_gathers(tiny_model, reference, monkeypatch, caplog):
    """In place passes the load-time check but raises inside capture: the model gathers and its
    graphs are captured again (before, every graph was dropped); the warning keeps the traceback."""
    from engine.model.paged_attention import PagedAttention

    attend = PagedAttention.attend

    def fails_when_captured(self, *args):
        if CaptureMarking.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        return attend(self, *args)

    monkeypatch.setattr(PagedAttention, "attend", fails_when_captured)
    config = EngineConfig.from_kwargs(model=str(tiny_model[0]), cuda_graphs="on", paged_attention="inplace", **COMMON)
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine(config, graph_capture=CaptureMarking())
    assert engine.cuda_graphs["target"].graphs == 3 and engine.cuda_graphs["target"].fallback is None
    assert engine.model.paged is None
    assert engine.paged_attention["target"].startswith("gather: graph capture failed in place: capture failed: "
                                                       "RuntimeError: operation not permitted")
    assert any("Traceback" in r.getMessage() and "fails_when_captured" in r.getMessage() for r in caplog.records)
    llm = LLM.__new__(LLM)
    llm.config, llm.engine = config, engine
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(16))] == reference and engine.model.graphs.replays > 0


def test_plain_greedy_with_graphs_equals_eager(tiny_model, reference):
    llm = LLM(model=str(tiny_model[0]), cuda_graphs="on", **COMMON)
    assert llm.engine.cuda_graphs["target"].graphs == 3 and llm.engine.cuda_graphs["target"].fallback is None
    alone = [llm.generate(p, greedy(16))[0].token_ids for p in PROMPTS]
    assert alone == reference and [o.token_ids for o in llm.generate(PROMPTS, greedy(16))] == reference
    assert llm.engine.model.graphs.replays > 0


def test_speculative_greedy_with_a_draft_model_and_graphs_equals_plain(tiny_model, tiny_draft, reference):
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
              speculative_method="draft", spec_policy="fixed", spec_length=3, cuda_graphs="on", **COMMON)
    assert {r: v.graphs for r, v in llm.engine.cuda_graphs.items()} == {"target": 6, "draft": 6}
    outs = llm.generate(PROMPTS, greedy(16))
    assert [o.token_ids for o in outs] == reference
    assert sum(o.num_draft_tokens for o in outs) > 0
    assert llm.engine.model.graphs.replays > 0 and llm.engine.draft_model.graphs.replays > 0




def test_speculative_greedy_with_an_eagle3_head_and_graphs_equals_plain(tiny_model, tiny_head, reference):
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_head), use_speculative_decoding=True,
              speculative_method="eagle", spec_policy="fixed", spec_length=3, cuda_graphs="on", **COMMON)
    assert all(r.fallback is None for r in llm.engine.cuda_graphs.values())
    assert llm.engine.model.graphs.layers == llm.engine.draft_model.aux_layers  # the target's graphs keep features
    outs = llm.generate(PROMPTS, greedy(16))
    assert [o.token_ids for o in outs] == reference
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert llm.engine.model.graphs.replays > 0 and llm.engine.draft_model.graphs.replays > 0


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_speculative_greedy_trees_with_graphs_equal_plain(tiny_model, tiny_draft, tiny_head, reference, method):
    draft = tiny_draft[0] if method == "draft" else tiny_head
    llm = LLM(model=str(tiny_model[0]), draft_model=str(draft), use_speculative_decoding=True,
              speculative_method=method, spec_policy="fixed", spec_length=3, tree_width=3, tree_tokens=7,
              cuda_graphs="on", **COMMON)
    assert all(r.fallback is None for r in llm.engine.cuda_graphs.values())
    outs = llm.generate(PROMPTS, greedy(16))
    assert [o.token_ids for o in outs] == reference
    assert sum(o.num_draft_tokens for o in outs) > 0
    # the verify passes and the drafting passes over the trees' newest nodes replay graphs
    assert llm.engine.model.graphs.tree_replays > 0 and llm.engine.draft_model.graphs.tree_replays > 0
