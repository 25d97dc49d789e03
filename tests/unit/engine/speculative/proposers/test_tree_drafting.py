"""Token trees drafted by the model proposers (engine/speculative/tree_drafting.py): every node fed
in a drafting pass (its frontier beside its cousins, under a tree mask) gets the logits its path
gets when replayed as a chain (the draft model's chunk pass; the EAGLE-3 head's one-token steps on
its own outputs), and its children are its likeliest tokens; the trees keep the likeliest nodes
with their parents, and the proposer's pool holds only what precedes the round after it (float32;
slotted and paged pools)."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative.proposers.tree_drafting import _Growing, draft_trees
from engine.token_tree import TokenTree
from engine.uniforms import RandomStream
from tests.helpers import make_eagle3_head

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "x", "for i in range(10):\n    print(i)\n"]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, tiny_model):
    path = tmp_path_factory.mktemp("tree_eagle3")
    vocab = json.loads((tiny_model[0] / "config.json").read_text())["vocab_size"]
    # random attention (not test_eagle's two_back head, whose attention adds nothing): a node seeing
    # a sibling would change its logits
    make_eagle3_head(path, tiny_model[0], seed=3, aux=[0, 1, 1], draft_vocab=[i for i in range(vocab) if i % 3 != 2])
    return path


def _replay(proposer, request, base: int, path: list[int], root_hidden: torch.Tensor | None) -> torch.Tensor:
    """The proposer's logits [V] after `path` run as a chain from its pool's length `base` (rolled back after)."""
    slot = proposer.kv.draft_slot(request)
    try:
        if root_hidden is None:  # a draft model: one chunk pass
            return proposer._forward([request], [path], [base])[0]
        hidden = root_hidden[None, None]  # [1, 1, H] an EAGLE-3 head: one-token steps on its own outputs
        for token in path:
            logits, out = proposer._pass_one([request], [token], hidden)
            hidden = out[:, None]
        return logits[0]
    finally:
        proposer.kv.draft.truncate_to(slot, base, keep_storage=True)


@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_every_fed_node_gets_its_paths_chain_logits(tiny_model, tiny_draft, head_dir, backend, method):
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0] if method == "draft" else head_dir),
              use_speculative_decoding=True, speculative_method=method, spec_policy="fixed", spec_length=3,
              tree_width=3, tree_tokens=10, dtype="float32", kv_cache_backend=backend, block_size=4,
              max_seq_len=160, max_batch_size=8)
    proposer = llm.engine.speculation.proposer
    passes, roots, checked = [], {}, {"nodes": 0, "rounds": 0}
    feed, catch_up, propose_trees = proposer._feed_tree, proposer._catch_up, proposer.propose_trees

    def recording_feed(reqs, bases, *rest):
        rows, trees, counts = rest[-3:]
        logits = feed(reqs, bases, *rest)
        passes.append([(reqs[i], bases[i], t, n, logits[j, :n].clone()) for j, (i, t, n) in
                       enumerate(zip(rows, trees, counts))])
        return logits

    def recording_catch_up(reqs, *rest):
        out = catch_up(reqs, *rest)
        if method == "eagle":
            logits, hidden = out
            roots.update({r.request_id: (logits[i].clone(), hidden[i].clone()) for i, r in enumerate(reqs)})
        else:
            roots.update({r.request_id: (out[i].clone(), None) for i, r in enumerate(reqs)})
        return out

    def checking(requests, depths, budgets, width):
        passes.clear()
        roots.clear()
        before = [proposer.kv.draft_len(r) for r in requests]
        trees = propose_trees(requests, depths, budgets, width)
        for group in passes:
            for r, base, tree, n, logits in group:
                assert proposer.kv.draft_len(r) == base  # the tree's K/V is gone after the round
                for k in range(n):
                    node = len(tree) - n + k
                    path = [tree.tokens[j] for j in tree.path(node)]
                    expected = _replay(proposer, r, base, path, roots[r.request_id][1])
                    finite = torch.isfinite(expected)
                    assert torch.equal(finite, torch.isfinite(logits[k]))
                    torch.testing.assert_close(logits[k][finite], expected[finite], rtol=1e-4, atol=1e-4)
                    checked["nodes"] += 1
        for r, tree, budget, b in zip(requests, trees, budgets, before):
            if tree is None:
                continue
            checked["rounds"] += 1
            assert len(tree) <= budget and tree.depth <= depths[requests.index(r)]
            top = roots[r.request_id][0].topk(width).indices.tolist()  # the root's children: its likeliest tokens
            assert [tree.tokens[c] for c in tree.children[0]] == top[:len(tree.children[0])]
            assert b <= proposer.kv.draft_len(r)  # caught up, nothing of the tree left
            assert method == "eagle" or proposer.kv.draft_len(r) == r.num_tokens
        return trees

    proposer._feed_tree, proposer._catch_up, proposer.propose_trees = recording_feed, recording_catch_up, checking
    llm.engine.speculation.proposer = proposer
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert checked["nodes"] > 20 and checked["rounds"] > 5, checked


def _growing(scores: dict[int, tuple[int, float]], budget: int) -> _Growing:
    """Candidates (token -> (parent candidate, log-probability)) in proposal order."""
    g = _Growing(depth=4, budget=budget)
    for token, (parent, lp) in scores.items():
        g.tokens.append(token)
        g.parents.append(parent)
        g.scores.append((g.scores[parent] if parent >= 0 else 0.0) + lp)
        g.depths.append(g.depths[parent] + 1 if parent >= 0 else 1)
    return g


def test_the_rerank_keeps_the_likeliest_nodes_with_their_parents_siblings_by_probability():
    #  root: 10 (-0.1), 11 (-1.0), 12 (-2.0); 10: 13 (-0.2), 14 (-0.3); 13: 15 (-2.5); 11: 16 (-0.05)
    g = _growing({10: (-1, -0.1), 11: (-1, -1.0), 12: (-1, -2.0), 13: (0, -0.2), 14: (0, -0.3), 15: (3, -2.5),
                  16: (1, -0.05)}, budget=5)
    # scores: 10 -0.1, 13 -0.3, 14 -0.4, 11 -1.0, 16 -1.05, 12 -2.0, 15 -2.8
    assert g.tree() == TokenTree((10, 13, 14, 11, 16), (-1, 0, 0, -1, 3))
    assert g.frontier(1, 3) == [0, 1]  # 12 ranks 5th: its children could not make a tree of 5
    g.fed = [0, 1]
    assert g.frontier(2, 3) == [3, 4] and g.frontier(2, 1) == [3]  # 16 ranks 5th


def _drawn_tree(seed: int, root: torch.Tensor, after: torch.Tensor, width: int = 3, budget: int = 7,
                depth: int = 3, temperature: float = 0.7) -> tuple[TokenTree, RandomStream]:
    """draft_trees for one sampled request whose draft gives `root` [V] after the root and `after`
    [V] after every node."""
    stream = RandomStream(seed)
    req = SimpleNamespace(params=SamplingParams(temperature=temperature), random_stream=stream, grammar=None)

    def feed(rows, trees, counts):
        return after.expand(len(rows), max(counts), after.shape[0])

    return draft_trees([req], [depth], [budget], width, root[None], feed)[0], stream


def test_a_sampled_requests_tree_is_drawn_without_replacement_and_keeps_every_draw():
    root, after = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -9.0]), torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 3.0])
    q_root, q_after = (root / 0.7).softmax(-1), (after / 0.7).softmax(-1)
    tree, stream = _drawn_tree(11, root, after)
    # the root's 3 children; the likeliest of them 3 children (the next would take the node kept for
    # depth 3); one child of the likeliest of those (the budget of 7 spent)
    assert len(tree) == 7 and tree.depth == 3 and len(tree.children[0]) == 3
    assert sorted(len(tree.children[c + 1]) for c in tree.children[0]) == [0, 0, 3]
    likeliest = max(tree.children[0], key=lambda c: float(q_root[tree.tokens[c]]))
    assert len(tree.children[likeliest + 1]) == 3
    second = max(tree.children[likeliest + 1], key=lambda c: float(q_after[tree.tokens[c]]))
    assert [len(tree.children[c + 1]) for c in tree.children[likeliest + 1]].count(1) == 1
    assert len(tree.children[second + 1]) == 1
    for kids in tree.children:
        assert len({tree.tokens[c] for c in kids}) == len(kids)  # siblings never repeat
    assert stream.counter == 3 * 3  # width uniforms for the root and each of the 2 expanded nodes

    torch.testing.assert_close(tree.children_q(0), q_root)
    for node in range(len(tree)):
        if tree.children[node + 1]:
            torch.testing.assert_close(tree.children_q(node + 1), q_after)
        else:
            assert tree.children_q(node + 1) is None
    assert tree.q.shape[0] == 3  # read to the host: the root's row and the 2 expanded nodes' only


def test_a_small_drawn_tree_still_reaches_its_depth():
    tree, _ = _drawn_tree(5, torch.tensor([2.0, 1.5, 1.0, 0.5]), torch.tensor([0.0, 1.0, 2.0, 0.0]), width=4,
                          budget=5)
    # a chain of 3 (the depth) and the root's two other children
    assert len(tree) == 5 and tree.depth == 3 and len(tree.children[0]) == 3


def test_drawn_siblings_follow_sampling_without_replacement():
    """The root's first two children over many seeds: P(a, b) = q(a) q(b) / (1 - q(a)). The same
    counts reject independent draws (q(a) q(b)), so the test can tell the two apart."""
    from scipy.stats import chisquare

    root, after = torch.tensor([1.0, 0.6, 0.2, 0.0]), torch.zeros(4)
    q = (root / 0.7).softmax(-1).double()
    seen = Counter()
    n = 3000
    for seed in range(n):
        tree, _ = _drawn_tree(seed, root, after, width=2, budget=2, depth=1)
        seen[tuple(tree.tokens[c] for c in tree.children[0])] += 1
    cells = [(a, b) for a in range(4) for b in range(4)]
    without = [float(q[a] * q[b] / (1 - q[a])) if a != b else 0.0 for a, b in cells]
    independent = [float(q[a] * q[b]) for a, b in cells]
    kept = [i for i, w in enumerate(without) if w > 0]
    observed = [seen[cells[i]] for i in kept]
    assert sum(observed) == n

    def expected(law):
        total = sum(law[i] for i in kept)
        return [n * law[i] / total for i in kept]

    assert chisquare(observed, expected(without)).pvalue > 1e-3
    assert chisquare(observed, expected(independent)).pvalue < 1e-3


def _fed_tokens(trees, counts) -> list[list[int]]:
    return [list(t.tokens[len(t) - n:]) for t, n in zip(trees, counts)]


def test_several_drawn_nodes_of_a_depth_each_get_their_own_q_and_uniforms():
    """Width 4, 12 nodes, depth 2: the root's 4 children are all expanded (4, 2, 1 and 1 children).
    Each expanded node's q row is its own logits' (the feed's logits depend on the node's token),
    and each draws from its own uniforms (with the same logits everywhere, their first children
    differ)."""
    V, T = 40, 0.7
    base = torch.linspace(0.0, 1.0, V)

    def bumped(token: int) -> torch.Tensor:
        return base + 3.0 * torch.nn.functional.one_hot(torch.tensor(token), V)

    stream = RandomStream(3)
    req = SimpleNamespace(params=SamplingParams(temperature=T), random_stream=stream, grammar=None)

    def feed(rows, trees, counts):
        return torch.stack([torch.stack([bumped(t) for t in fed] + [base] * (max(counts) - len(fed)))
                            for fed in _fed_tokens(trees, counts)])

    tree = draft_trees([req], [2], [12], 4, base[None], feed)[0]
    assert len(tree) == 12 and sorted(len(tree.children[c + 1]) for c in tree.children[0]) == [1, 1, 2, 4]
    for c in tree.children[0]:
        torch.testing.assert_close(tree.children_q(c + 1), (bumped(tree.tokens[c]) / T).softmax(-1))
    for seed in range(5):
        req.random_stream = RandomStream(seed)
        flat = draft_trees([req], [2], [12], 4, base[None], lambda rows, trees, counts: base.expand(1, max(counts), V))[0]
        firsts = {flat.tokens[flat.children[c + 1][0]] for c in flat.children[0]}
        assert len(firsts) > 1, seed  # the same logits: only the uniforms tell the nodes apart


def _drawn_rounds(n: int, seed: int, keep=None) -> list[tuple]:
    """n rounds of a toy proposer's trees drawn by draft_trees (width 2, 5 nodes, depth 2: both of
    the root's children expanded, 2 and 1 children) and accepted against a toy target, each
    output continued by sampling the target to 4 tokens. keep: a wrong rule choosing the tree's
    nodes (the teeth)."""
    from engine.speculative.verify.tree import accept_sampled
    from tests.helpers import continue_with, toy_lm

    target, proposer = toy_lm(1, 3, 4, 0.5), toy_lm(2, 3, 4, 0.5)
    gen = torch.Generator().manual_seed(seed)
    req = SimpleNamespace(params=SamplingParams(temperature=1.0), random_stream=RandomStream(seed), grammar=None)

    def feed(rows, trees, counts):
        tree, fed = trees[0], counts[0]
        return torch.stack([proposer[tuple(tree.tokens[j] for j in tree.path(node))].log()
                            for node in range(len(tree) - fed, len(tree))])[None]

    out = []
    for _ in range(n):
        tree = draft_trees([req], [2], [5], 2, proposer[()].log()[None], feed)[0]
        if keep is not None:
            tree = keep(tree, proposer)
        prefixes = [()] + [tuple(tree.tokens[j] for j in tree.path(i)) for i in range(len(tree))]
        p = torch.stack([target[x] for x in prefixes])
        path, final = accept_sampled(tree, p, torch.rand(len(tree) + 1, generator=gen, dtype=torch.float64).tolist())
        emitted = tuple(tree.tokens[i] for i in path) + (int(torch.multinomial(final, 1, generator=gen)),)
        out.append(continue_with(target, emitted, 4, gen))
    return out, target


def _keep_likeliest_first_child(tree, proposer):
    """A wrong tree: kept only when the root's first drawn child is the proposer's likeliest token
    (a choice by the child's own draw), else no tree at all."""
    if tree.tokens[tree.children[0][0]] == int(proposer[()].argmax()):
        return tree
    return TokenTree((), (), tree.children_q(0)[None])


def test_drawn_trees_accepted_follow_the_target_exactly():
    from tests.helpers import chi2_sequences

    sequences, target = _drawn_rounds(12000, seed=7)
    assert chi2_sequences(sequences, target, 3, 4) > 1e-3


def test_teeth_drawn_children_kept_by_their_own_draw_are_detected():
    from tests.helpers import chi2_sequences

    sequences, target = _drawn_rounds(12000, seed=8, keep=_keep_likeliest_first_child)
    assert chi2_sequences(sequences, target, 3, 4) < 1e-3
