"""Model-free proposals by prompt lookup: the tokens that followed the most recent earlier
occurrence of the sequence's last m tokens (m from max_n down to min_n); q is one-hot. After a
one-token match at most `one_token_match_max` (performance-notes#n-gram-one-token-cut).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.request import Request
from engine.speculative.proposer import LONG_CATCH_UP, Proposal, one_hot_q


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


class NgramProposer:
    name = "ngram"
    runs_model = False
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

    def lag(self, requests: list[Request]) -> list[int]:
        return [0] * len(requests)
