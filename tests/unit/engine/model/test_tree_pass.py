"""One target pass over token trees: every node's logits equal those of its path run as a chain
(bitwise under the float32 row-invariant rule); after the accepted path's K/V is moved into place, the sequence continues as if the path had
been decoded one token at a time (float32; slotted and paged pools; one sequence and a batch
mixing trees with chains)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ModelPlan
from engine.kv import make_pool
from engine.model.invariance import choose_invariance
from engine.model.kernels import one_sequence
from engine.model.loader import load_model
from engine.model.passes import forward_chunks
from engine.token_tree import TokenTree

#      root
#     /    \
#    0      1
#   / \     |
#  2   3    4
#  |
#  5
TREE = TokenTree((21, 40, 22, 57, 41, 23), (-1, -1, 0, 0, 1, 2))
PROMPTS = [[(7 * i) % 300 + 3 for i in range(n)] for n in (19, 33, 5)]


@pytest.fixture(scope="module", params=["plan", pytest.param("invariant", marks=pytest.mark.skipif(
    one_sequence.load() is None, reason="the CPU kernels do not build here"))])
def model(tiny_model, request):
    """The float32 model on its plan's paths (logits within 1e-4 of the chain's), or on the
    row-invariant rule (engine/model/invariance.py: the chain's bits exactly)."""
    m = load_model(Path(tiny_model[0]), ModelPlan("float32"), "cpu", max_positions=512)
    if request.param == "invariant":
        assert choose_invariance(m, "on") == "on"
    return m


def _same(got: torch.Tensor, want: torch.Tensor, model) -> None:
    if model.row_invariant:
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _pool(model, backend: str):
    s = model.shape
    return make_pool(backend, num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                     max_slots=4, max_seq_len=256, dtype=model.dtype, device="cpu", block_size=16,
                     num_blocks=None, enable_prefix_caching=False)


def _prefilled(model, pool, prompts: list[list[int]]) -> list[int]:
    slots = [pool.allocate_slot([])[0] for _ in prompts]
    for slot, prompt in zip(slots, prompts):
        forward_chunks(model, pool, [slot], [prompt[:-1]], [0])  # the last token is each round's root
    return slots


def _chain_logits(model, backend: str, prompt: list[int], path_tokens: list[int]) -> torch.Tensor:
    """Logits [len(path) + 1, V] of the root and the path decoded as a chain, in a fresh pool."""
    pool = _pool(model, backend)
    (slot,) = _prefilled(model, pool, [prompt])
    return forward_chunks(model, pool, [slot], [[prompt[-1]] + path_tokens], [len(prompt) - 1], all_logits=True)[0]


@pytest.mark.parametrize("backend", ["paged", "slotted"])
def test_every_node_sees_its_path_only(model, backend):
    pool = _pool(model, backend)
    slots = _prefilled(model, pool, PROMPTS)
    starts = [len(p) - 1 for p in PROMPTS]
    chain = [5, 9]  # the middle row: a chain in the same pass
    chunks = [[PROMPTS[0][-1], *TREE.tokens], [PROMPTS[1][-1], *chain], [PROMPTS[2][-1], *TREE.tokens]]
    trees = [TREE, None, TREE]
    logits = forward_chunks(model, pool, slots, chunks, starts, all_logits=True, trees=trees)  # [3, 7, V]
    for row in (0, 2):
        for node in range(-1, len(TREE)):
            path = [TREE.tokens[i] for i in TREE.path(node)]
            expected = _chain_logits(model, backend, PROMPTS[row], path)[-1]
            _same(logits[row, node + 1], expected, model)
    _same(logits[1, :3], _chain_logits(model, backend, PROMPTS[1], chain), model)


@pytest.mark.parametrize("backend", ["paged", "slotted"])
@pytest.mark.parametrize("accepted", [[1, 4], [0, 3], [0, 2, 5], []])
def test_the_accepted_path_moved_into_place_continues_like_a_chain(model, backend, accepted):
    prompt = PROMPTS[1]
    pool = _pool(model, backend)
    (slot,) = _prefilled(model, pool, [prompt])
    start = len(prompt) - 1
    forward_chunks(model, pool, [slot], [[prompt[-1], *TREE.tokens]], [start], all_logits=True,
                   trees=[TREE])
    pool.move_rows([(slot, start + 1 + node, start + 1 + j) for j, node in enumerate(accepted)])
    pool.truncate_to(slot, start + 1 + len(accepted))
    path = [TREE.tokens[i] for i in accepted]
    after = forward_chunks(model, pool, [slot], [[99, 100]], [start + 1 + len(accepted)], all_logits=True)[0]
    expected = _chain_logits(model, backend, prompt, path + [99, 100])[-2:]
    _same(after, expected, model)


def test_move_rows_checks_positions(model):
    pool = _pool(model, "paged")
    (slot,) = _prefilled(model, pool, [PROMPTS[2]])
    with pytest.raises(ValueError, match="below slot"):
        pool.move_rows([(slot, 10, 1)])
