"""Model-free proposals by prompt lookup (n-gram matching).

For a sequence x_1..x_n: take its last m tokens (m from `max_n` down to `min_n`), find the
most recent earlier place where those m tokens occur, and propose the (up to k) tokens that
followed there. No match for any m -> no proposal. The proposal's q is one-hot, so exact
acceptance keeps the output distribution the target's.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
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
            return tokens[start:start + k]
    return []
