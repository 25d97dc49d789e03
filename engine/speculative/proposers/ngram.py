"""Model-free proposals by prompt lookup: the tokens that followed the most recent earlier
occurrence of the sequence's last m tokens (m from max_n down to min_n); q is one-hot. After a
one-token match at most `one_token_match_max` (performance-notes#n-gram-one-token-cut). As a
tree: the continuations of several earlier occurrences (most recent first) merged where they
share a prefix, each a chosen branch (a point mass, engine/speculative/tree.py).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.request import Request
from engine.speculative.proposers.base import LONG_CATCH_UP, Proposal, Proposer, one_hot_q
from engine.token_tree import TokenTree


def ngram_propose(tokens: list[int], k: int, max_n: int, min_n: int,
                  one_token_match_max: int | None = None) -> list[int]:
    """Up to k tokens that followed the longest recent match of the sequence's suffix (at most
    `one_token_match_max` of them when only a single token matched; None: no cut)."""
    n = len(tokens)
    if k <= 0 or n < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for m in range(min(max_n, n - 1), min_n - 1, -1):
        suffix = arr[n - m:]
        windows = sliding_window_view(arr[:n - 1], m)  # [n - m, m]; excludes the suffix itself
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + m  # the token after the most recent match
            limit = k if m > 1 or one_token_match_max is None else min(k, one_token_match_max)
            return tokens[start:start + limit]
    return []


def ngram_tree(tokens: list[int], depth: int, max_nodes: int, width: int, max_n: int, min_n: int,
               one_token_match_max: int | None = None) -> TokenTree | None:
    """The continuations (each up to `depth` tokens) of the most recent earlier occurrences of the
    sequence's suffix, the longest suffix first, merged into a prefix tree of at most `max_nodes`
    nodes and `width` children a node; siblings in the order their occurrences were found (the
    first branch is `ngram_propose`'s chain). None: no occurrence."""
    n = len(tokens)
    if depth <= 0 or max_nodes <= 0 or n < min_n + 1:
        return None
    arr = np.asarray(tokens, dtype=np.int64)
    branches: list[list[int]] = []
    for m in range(min(max_n, n - 1), min_n - 1, -1):
        suffix = arr[n - m:]
        windows = sliding_window_view(arr[:n - 1], m)  # [n - m, m]; excludes the suffix itself
        limit = depth if m > 1 or one_token_match_max is None else min(depth, one_token_match_max)
        for hit in np.flatnonzero((windows == suffix).all(axis=1))[::-1]:
            branch = tokens[int(hit) + m:int(hit) + m + limit]
            if branch and branch not in branches:
                branches.append(branch)
            if len(branches) >= width * depth:
                break
        if branches:
            break  # a longer match's continuations only: shorter ones are weaker evidence
    if not branches:
        return None
    nodes: list[int] = []
    parents: list[int] = []
    children: dict[int, dict[int, int]] = {}  # node (-1: root) -> token -> child node
    for branch in branches:
        at = -1
        for token in branch:
            kids = children.setdefault(at, {})
            if token not in kids:
                if len(nodes) >= max_nodes or len(kids) >= width:
                    break
                kids[token] = len(nodes)
                nodes.append(token)
                parents.append(at)
            at = kids[token]
    return TokenTree(tuple(nodes), tuple(parents))


class NgramProposer(Proposer):
    name = "ngram"
    runs_model = False
    drafts_trees = True
    catch_up = "own"
    long_catch_up = LONG_CATCH_UP  # a lookup never catches up

    def __init__(self, vocab_size: int, device, max_n: int, min_n: int, one_token_match_max: int):
        self.vocab_size = vocab_size
        self.device = device
        self.max_n, self.min_n, self.one_token_match_max = max_n, min_n, one_token_match_max

    def propose(self, requests: list[Request], ks: list[int], with_q: bool) -> Proposal:
        tokens = [ngram_propose(r.all_token_ids, k, self.max_n, self.min_n, self.one_token_match_max)
                  for r, k in zip(requests, ks)]
        q = one_hot_q(tokens, self.vocab_size, self.device) if with_q else None
        return Proposal(tokens, q, [self.name if t else "none" for t in tokens])

    def propose_trees(self, requests: list[Request], depths: list[int], budgets: list[int],
                      width: int) -> list[TokenTree | None]:
        """A tree per request: depth at most depths[i], at most budgets[i] nodes (None: no match)."""
        return [ngram_tree(r.all_token_ids, d, b, width, self.max_n, self.min_n, self.one_token_match_max)
                for r, d, b in zip(requests, depths, budgets)]

    def lag(self, requests: list[Request]) -> list[int]:
        return [0] * len(requests)
