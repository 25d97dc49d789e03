"""How wide the adaptive policy's trees are: from how often each sibling rank was the one accepted.

At every node an accepted path visits (the root, then each accepted node), the children present
are counted by rank (their order among their siblings: 0 is the proposer's first), and the
accepted one's rank is a hit. A rank whose hits per presence stay below what a node costs (the
verify pass's measured seconds per extra node ÷ the tree rounds' seconds per token) is not worth
proposing: the width is 1 + the highest rank from 1 up that pays, at most the configured width.
An unmeasured rank counts as paying, and every EXPLORE_EVERY-th tree round takes the configured
width, so a rank dropped can come back. Greedy and sampled rows are counted apart (their trees
and acceptance differ: top-k and argmax matches, draws and rejection sampling), each row by its
own kind; a batch holding both takes the wider of their widths.
"""

from __future__ import annotations

from engine.token_tree import TokenTree

DECAY = 0.99  # per tree round: the weight the earlier rounds keep
EXPLORE_EVERY = 8  # tree rounds between rounds at the configured width


class RankAcceptance:
    def __init__(self, max_width: int = 8):
        self.max_width = max_width  # SpecConfig's bound on tree_width
        self._present: dict[bool, list[float]] = {}  # sampled rows? -> decayed count of children by rank
        self._hits: dict[bool, list[float]] = {}  # sampled rows? -> decayed count of accepted children by rank
        self._rounds = 0

    def observe(self, sampled: list[bool], trees: list[TokenTree | None], paths: list[list[int]]) -> None:
        """A tree round's trees, whether each row samples (not greedy) and each tree's accepted path
        (nodes, root to last)."""
        for kind in set(sampled):
            present = [DECAY * v for v in self._present.get(kind, [0.0] * self.max_width)]
            hits = [DECAY * v for v in self._hits.get(kind, [0.0] * self.max_width)]
            for tree, path, row_kind in zip(trees, paths, sampled, strict=True):
                if row_kind != kind or tree is None or not len(tree):
                    continue
                for depth, node in enumerate([-1] + path):
                    kids = tree.children[node + 1][:self.max_width]
                    for rank in range(len(kids)):
                        present[rank] += 1.0
                    if depth < len(path) and path[depth] in kids:
                        hits[kids.index(path[depth])] += 1.0
            self._present[kind], self._hits[kind] = present, hits

    def hit_rates(self, sampled: bool) -> list[float | None]:
        """Each rank's hits per presence in sampled (or greedy) rows' trees (None: never present)."""
        present, hits = self._present.get(sampled, []), self._hits.get(sampled, [])
        return [h / p if p > 0 else None for p, h in zip(present, hits)]

    def width(self, sampled: list[bool], configured: int, node_seconds: float, token_seconds: float | None) -> int:
        """The width of this tree round for rows that sample or not as `sampled` says (1 < result
        <= configured unless no sibling rank pays: 1)."""
        self._rounds += 1
        if token_seconds is None or token_seconds <= 0 or self._rounds % EXPLORE_EVERY == 0:
            return configured
        threshold = node_seconds / token_seconds  # the share of a token a node's verify costs
        width = 1
        for kind in set(sampled):
            rates = self.hit_rates(kind)
            for rank in range(width, configured):
                rate = rates[rank] if rank < len(rates) else None
                if rate is None or rate >= threshold:
                    width = rank + 1
        return width
