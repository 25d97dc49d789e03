"""Token trees: their shape (depths, children, the ancestor mask) and exact acceptance over them,
greedy and sampled, drawn or chosen children, against a toy language model's joint distribution."""

from __future__ import annotations

import pytest
import torch

from engine.speculative.verify.tree import accept_greedy, accept_sampled
from engine.token_tree import TokenTree
from tests.exactness import no_residual
from tests.helpers import chi2_sequences, continue_with, toy_lm

V, LENGTH = 3, 4  # toy vocabulary; sequences compared over the first 4 tokens (81 cells)
#      root
#     /    \
#    0      1          depth 1
#   / \     |
#  2   3    4          depth 2
#  |
#  5                   depth 3
SHAPE = (-1, -1, 0, 0, 1, 2)


def test_shape_depths_children_and_ancestor_mask():
    tree = TokenTree((5, 6, 7, 8, 9, 10), SHAPE)
    assert tree.depths == (1, 1, 2, 2, 2, 3) and tree.depth == 3 and not tree.is_chain
    assert tree.children == ((0, 1), (2, 3), (4,), (5,), (), (), ())
    assert tree.path(5) == [0, 2, 5] and tree.path(-1) == []
    mask = tree.ancestor_mask()  # rows and columns: root, nodes 0..5
    assert mask[6].tolist() == [True, True, False, True, False, False, True]  # node 5: root, 0, 2, itself
    assert mask[5].tolist() == [True, False, True, False, False, True, False]  # node 4: root, 1, itself
    assert mask.sum().item() == 1 + 2 + 2 + 3 + 3 + 3 + 4
    chain = TokenTree.chain([4, 4, 4])
    assert chain.is_chain and chain.parents == (-1, 0, 1) and torch.equal(chain.ancestor_mask(), torch.ones(4, 4).tril().bool())
    with pytest.raises(ValueError, match="parent"):
        TokenTree((1, 2), (-1, 1))
    with pytest.raises(ValueError, match="a parent per token"):
        TokenTree((1, 2), (-1,))


def test_greedy_follows_the_argmax_down_the_tree():
    tree = TokenTree((1, 2, 0, 1, 2, 2), SHAPE)
    # argmax after root, node 0..5: root -> 2 (node 1) -> 2 (node 4, a leaf) -> final 0
    assert accept_greedy(tree, [2, 9, 2, 9, 9, 0, 9]) == ([1, 4], 0)
    assert accept_greedy(tree, [0, 9, 9, 9, 9, 9, 9]) == ([], 0)  # no child matches: the argmax itself
    assert accept_greedy(tree, [1, 0, 9, 1, 9, 9, 9]) == ([0, 2], 1)  # node 2 has no child 1: its argmax follows
    assert accept_greedy(tree, [1, 0, 9, 2, 9, 9, 1]) == ([0, 2, 5], 1)  # node 5 is a leaf: its argmax follows


def _round(tree_of, target: dict, proposer: dict, n: int, seed: int, rule=accept_sampled) -> list[tuple]:
    """n rounds: a tree built from the toy proposer by `tree_of`, accepted against the toy target,
    the output continued by sampling the target to LENGTH tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tree = tree_of(proposer, gen)
        prefixes = [()] + [tuple(tree.tokens[j] for j in tree.path(i)) for i in range(len(tree))]
        p = torch.stack([target[x] for x in prefixes])  # [n + 1, V]
        path, final = rule(tree, p, torch.rand(len(tree) + 1, generator=gen, dtype=torch.float64).tolist())
        emitted = tuple(tree.tokens[i] for i in path) + (int(torch.multinomial(final, 1, generator=gen)),)
        out.append(continue_with(target, emitted, LENGTH, gen))
    return out


def drawn_tree(proposer: dict, gen: torch.Generator) -> TokenTree:
    """SHAPE with each node's children drawn without replacement from the proposer given the
    node's path (as tree_drafting draws them); q: each node's proposer distribution."""
    tokens: list[int] = []
    taken: dict[int, list[int]] = {}  # parent -> its children's tokens so far
    for parent in SHAPE:
        prefix = () if parent < 0 else tuple(tokens[j] for j in TokenTree(tuple(tokens), SHAPE[:len(tokens)]).path(parent))
        left = proposer[prefix].clone()
        left[taken.get(parent, [])] = 0.0
        tokens.append(int(torch.multinomial(left, 1, generator=gen)))
        taken.setdefault(parent, []).append(tokens[-1])
    tree = TokenTree(tuple(tokens), SHAPE)
    q = torch.stack([proposer[tuple(tokens[j] for j in tree.path(i))] for i in range(-1, len(tokens))])
    return TokenTree(tree.tokens, SHAPE, q)


def chosen_tree(proposer: dict, gen: torch.Generator) -> TokenTree:
    """The proposer's top two tokens after the root, its top one after each (a chosen tree, as
    EAGLE-2's top-k expansion or several n-gram matches give): point masses, q None."""
    first = proposer[()].argsort(descending=True)[:2].tolist()
    tokens, parents = list(first), [-1, -1]
    for i, t in enumerate(first):
        prefix = (t,)
        for _ in range(2):
            nxt = int(proposer[prefix].argmax())
            parents.append(i if len(prefix) == 1 else len(tokens) - 1)
            tokens.append(nxt)
            prefix += (nxt,)
    return TokenTree(tuple(tokens), tuple(parents))


@pytest.mark.parametrize("tree_of", [drawn_tree, chosen_tree])
def test_sampled_acceptance_on_trees_is_exact(tree_of):
    target, proposer = toy_lm(1, V, LENGTH, 0.5), toy_lm(2, V, LENGTH, 0.5)
    assert chi2_sequences(_round(tree_of, target, proposer, 12000, seed=3), target, V, LENGTH) > 1e-3


def _siblings_left_in(tree, p, uniforms):
    """A wrong rule for drawn trees: the residual as accept_sampled takes it, but every sibling's
    proposal the node's whole q, as if siblings were independent draws (earlier ones not taken out)."""
    node, path, used = -1, [], 0
    residual = p[0]
    while tree.children[node + 1]:
        q = tree.children_q(node + 1) / tree.children_q(node + 1).sum()
        accepted = None
        for c in tree.children[node + 1]:
            x = tree.tokens[c]
            hit = uniforms[used] < min(1.0, float(residual[x] / q[x]))
            used += 1
            if hit:
                accepted = c
                break
            left = (residual - q).clamp_min(0)
            residual = left / left.sum() if left.sum() > 0 else residual
        if accepted is None:
            return path, residual
        path.append(accepted)
        node = accepted
        residual = p[node + 1]
    return path, residual


@pytest.mark.parametrize("tree_of", [drawn_tree, chosen_tree])
def test_teeth_siblings_tried_without_the_residual_are_rejected(tree_of):
    target, proposer = toy_lm(1, V, LENGTH, 0.5), toy_lm(2, V, LENGTH, 0.5)
    sequences = _round(tree_of, target, proposer, 12000, seed=4, rule=no_residual)
    assert chi2_sequences(sequences, target, V, LENGTH) < 1e-3


def test_teeth_drawn_siblings_need_the_earlier_ones_taken_out_of_q():
    target, proposer = toy_lm(1, V, LENGTH, 0.5), toy_lm(2, V, LENGTH, 0.5)
    sequences = _round(drawn_tree, target, proposer, 12000, seed=4, rule=_siblings_left_in)
    assert chi2_sequences(sequences, target, V, LENGTH) < 1e-3


def test_a_tree_accepts_more_than_its_first_chain():
    """The same drawn trees, accepted whole and cut to their first chain (node 0, 2, 5: each the
    first draw of its parent): the tree's other branches add accepted tokens on average."""
    target, proposer = toy_lm(1, V, LENGTH, 0.5), toy_lm(2, V, LENGTH, 0.5)
    gen = torch.Generator().manual_seed(5)
    whole = chain = 0
    first = [0, 2, 5]
    for _ in range(3000):
        tree = drawn_tree(proposer, gen)
        prefixes = [()] + [tuple(tree.tokens[j] for j in tree.path(i)) for i in range(len(tree))]
        p = torch.stack([target[x] for x in prefixes])
        u = torch.rand(len(tree) + 1, generator=gen, dtype=torch.float64).tolist()
        whole += len(accept_sampled(tree, p, u)[0])
        rows = [0] + [i + 1 for i in first]
        sub = TokenTree([tree.tokens[i] for i in first], (-1, 0, 1), tree.q[rows])
        chain += len(accept_sampled(sub, p[rows], u)[0])
    assert whole > 1.1 * chain


def test_a_drawn_tree_needs_a_q_row_per_node_and_the_root():
    with pytest.raises(ValueError, match="q"):
        TokenTree((1, 2), (-1, 0), torch.ones(2, V))
    with pytest.raises(ValueError, match="q_rows"):  # a row of q for the root and each node, or -1
        TokenTree((1, 2), (-1, 0), torch.ones(2, V), q_rows=(0, 1))
    with pytest.raises(ValueError, match="q_rows"):
        TokenTree((1, 2), (-1, 0), torch.ones(2, V), q_rows=(0, 2, -1))
    # the expanded rows only: the root's and node 0's; node 1, a leaf, has none
    tree = TokenTree((1, 2), (-1, 0), torch.stack([torch.full((V,), 1.0 / V), torch.eye(V)[2]]), q_rows=(0, 1, -1))
    assert tree.children_q(1)[2] == 1.0 and tree.children_q(2) is None
