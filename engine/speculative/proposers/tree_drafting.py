"""Token trees drafted by a model proposer, EAGLE-2's way. From the root, each depth's frontier
(the `width` likeliest nodes of that depth by path probability: the draft's log-probabilities
summed along the path) is fed in one batched pass under a tree mask (kv/tree_view.py), each of its
nodes proposing its `width` likeliest children; in the end the `budget` likeliest nodes overall
make the tree (the rerank: a node's path probability is at most its parent's, so a kept node's
parent is kept), parents first, siblings by descending probability.

A greedy request's children are chosen (point masses: a tree without q). A sampled request's are
drawn without replacement from the draft's sampling distribution (temperature and filters as the
target's; the tree keeps each node's q), so the first child is distributed as a chain's draft
and the siblings add to it (tree.accept_sampled). A drawn child is never dropped for its own
draw, which would bias it: the tree keeps every drawn node, the node budget being spent before
the draws: the likeliest node of a depth gets `width` children, the next half as many, and so
on, while they fit beside a chain down to the tree's depth.
A request with a grammar expands a node only over what the grammar allows after the node's path
(the verify pass masks and cuts again: tree_round).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine import host_sync
from engine.grammar import GrammarMatcher, mask_logits, new_bitmask, unpack_bitmask
from engine.request import Request
from engine.sampling import SamplingRows, adjusted_probs, inverse_cdf
from engine.token_tree import TokenTree
from engine.uniforms import draw_uniforms

# rows (indices into the batch) still growing, each one's tree of the nodes fed so far (this
# pass's nodes last), how many of them this pass feeds -> their logits [len(rows), W, V] (W: the
# most nodes a row feeds; a row's columns past its count are padding)
FeedFn = Callable[[list[int], list[TokenTree], list[int]], torch.Tensor]


@dataclass
class _Growing:
    """One request's candidates: every child proposed so far, in the order they were proposed."""

    depth: int  # the deepest a node may be
    budget: int  # nodes the tree may keep (and the most nodes fed: the draft pool's reserved room)
    drawn: bool = False  # children drawn from the draft's sampling distribution (a sampled request)
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # a candidate's parent candidate (-1: the root)
    scores: list[float] = field(default_factory=list)  # log path probability
    depths: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # candidates fed, in feed order (the draft pool's)
    # a drawn row's: candidate (-1: the root) -> the q [V] its children were drawn from; how many to draw
    q_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    planned: dict[int, int] = field(default_factory=dict)

    @property
    def room(self) -> int:
        return self.budget - len(self.tokens)

    def add_children(self, parent: int, values: list[float], ids: list[int]) -> None:
        base = self.scores[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        for v, t in zip(values, ids):
            if math.isfinite(v):  # -inf: a token outside the draft's vocabulary or the grammar
                self.tokens.append(t)
                self.parents.append(parent)
                self.scores.append(base + v)
                self.depths.append(depth)

    def ranked(self) -> list[int]:
        """Candidates by descending path probability, earlier first on a tie (so parents first)."""
        return sorted(range(len(self.tokens)), key=lambda c: (-self.scores[c], c))

    def frontier(self, depth: int, width: int) -> list[int]:
        """The nodes of `depth` to expand: the `width` likeliest whose children could still make
        the final tree (a child ranks below its parent, which must rank above the budget's last),
        within the room left to feed. A drawn row's: the likeliest of `depth` by rank, the r-th
        planned max(1, width >> r) children while the room lasts, a node kept for each depth below."""
        if self.drawn:
            self.planned, room = {}, max(min(1, self.room), self.room - max(0, self.depth - depth - 1))
            for rank, c in enumerate([c for c in self.ranked() if self.depths[c] == depth][:width]):
                if room <= 0:
                    break
                self.planned[c] = min(max(1, width >> rank), room)
                room -= self.planned[c]
            return list(self.planned)
        order = self.ranked()
        room = self.budget - len(self.fed)
        worth = [c for rank, c in enumerate(order) if rank <= self.budget - 2 and self.depths[c] == depth]
        return worth[:min(width, room)]

    def fed_tree(self) -> TokenTree:
        """The fed nodes as a tree, in feed order."""
        at = {c: i for i, c in enumerate(self.fed)}
        return TokenTree(tuple(self.tokens[c] for c in self.fed),
                         tuple(at[self.parents[c]] if self.parents[c] >= 0 else -1 for c in self.fed))

    def path(self, c: int) -> list[int]:
        """The tokens from the root's child down to candidate c (empty for the root, -1)."""
        out = []
        while c >= 0:
            out.append(self.tokens[c])
            c = self.parents[c]
        return out[::-1]

    def tree(self) -> TokenTree | None:
        """The `budget` likeliest candidates, parents first, siblings by descending probability; a
        drawn row's every candidate, siblings in draw order (q added by `_with_q`)."""
        if self.drawn:
            return TokenTree(tuple(self.tokens), tuple(self.parents)) if self.tokens else None
        kept: dict[int, int] = {}  # candidate -> node
        for c in self.ranked():
            if len(kept) == self.budget:
                break
            if self.parents[c] < 0 or self.parents[c] in kept:
                kept[c] = len(kept)
        if not kept:
            return None
        return TokenTree(tuple(self.tokens[c] for c in kept),
                         tuple(kept[self.parents[c]] if self.parents[c] >= 0 else -1 for c in kept))

    def q_table(self) -> tuple[torch.Tensor, tuple[int, ...]]:
        """A drawn row's children's q for the root and each expanded candidate [m, V], and where
        each of the tree's n + 1 rows is in it (-1: a leaf's)."""
        expanded = sorted(self.q_rows)  # -1 (the root) first
        at = {c: j for j, c in enumerate(expanded)}
        return torch.stack([self.q_rows[c] for c in expanded]), tuple(at.get(c, -1) for c in range(-1, len(self.tokens)))


def draft_trees(reqs: list[Request], depths: list[int], budgets: list[int], width: int, root_logits: torch.Tensor,
                feed: FeedFn) -> list[TokenTree | None]:
    """A tree per request (None where depths[i] or budgets[i] is 0, or nothing could be proposed):
    the root's children from root_logits [N, V] (the draft's after each request's last token),
    then one `feed` pass per depth over the rows whose frontier is not empty."""
    rows = [_Growing(d, b, drawn=not r.params.greedy) for r, d, b in zip(reqs, depths, budgets)]
    live = [i for i, g in enumerate(rows) if g.depth > 0 and g.budget > 0]
    if live:
        index = host_sync.upload(live, root_logits.device, torch.long)  # [n]
        _expand(reqs, rows, [(i, -1) for i in live], root_logits.index_select(0, index), width)
    for depth in range(1, max(depths, default=0)):
        frontiers = {i: rows[i].frontier(depth, width) for i in live if rows[i].depth > depth}
        growing = [i for i, f in frontiers.items() if f]
        if not growing:
            break
        for i in growing:
            rows[i].fed += frontiers[i]
        logits = feed(growing, [rows[i].fed_tree() for i in growing], [len(frontiers[i]) for i in growing])
        W = logits.shape[1]
        at = host_sync.upload([j * W + k for j, i in enumerate(growing) for k in range(len(frontiers[i]))],
                              logits.device, torch.long)  # [M] the fed nodes' rows of logits
        nodes = [(i, c) for i in growing for c in frontiers[i]]
        _expand(reqs, rows, nodes, logits.reshape(-1, logits.shape[-1]).index_select(0, at), width)
    return _with_q(rows, [g.tree() for g in rows])


def _with_q(rows: list[_Growing], trees: list[TokenTree | None]) -> list[TokenTree | None]:
    """The drawn trees with their q on the host (the expanded nodes' rows only), in one read."""
    drawn = [i for i, (g, t) in enumerate(zip(rows, trees)) if g.drawn and t is not None]
    if not drawn:
        return trees
    parts = [rows[i].q_table() for i in drawn]
    tables = host_sync.fetch(torch.cat([table for table, _ in parts]))  # [sum(m_i), V]
    out, first = list(trees), 0
    for i, (table, at) in zip(drawn, parts):
        m = table.shape[0]
        out[i] = dataclasses.replace(trees[i], q=tables[first:first + m], q_rows=at)
        first += m
    return out


def _expand(reqs: list[Request], rows: list[_Growing], nodes: list[tuple[int, int]], logits: torch.Tensor,
            width: int) -> None:
    """Each (row, candidate) of `nodes` (-1: the row's root) gets its children from its logits
    [M, V] (what its grammar allows after its path): chosen on greedy rows, drawn on sampled ones."""
    allowed = _grammar_masks(reqs, rows, nodes, logits.shape[-1])
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    drawn = [m for m, (i, _) in enumerate(nodes) if rows[i].drawn]
    chosen = [m for m, (i, _) in enumerate(nodes) if not rows[i].drawn]
    for part, expand in ((chosen, _choose), (drawn, _draw)):
        if part:
            some = logits if len(part) == len(nodes) else logits.index_select(
                0, host_sync.upload(part, logits.device, torch.long))  # [len(part), V]
            expand(reqs, rows, [nodes[m] for m in part], some, width)


def _choose(reqs: list[Request], rows: list[_Growing], nodes: list[tuple[int, int]], logits: torch.Tensor,
            width: int) -> None:
    """Each node's `width` likeliest children by logits [M, V], one read for all."""
    k = min(width, logits.shape[-1])
    values, ids = logits.float().log_softmax(dim=-1).topk(k, dim=-1)  # [M, k] each
    both = host_sync.read(torch.cat([values.double(), ids.double()], dim=-1))  # [M][2k], one read (ids exact)
    for (i, c), row in zip(nodes, both):
        rows[i].add_children(c, row[:k], [int(t) for t in row[k:]])


def _draw(reqs: list[Request], rows: list[_Growing], nodes: list[tuple[int, int]], logits: torch.Tensor,
          width: int) -> None:
    """Each node's planned children (at the root `width`, less what a chain below needs), drawn
    without replacement from q, the request's sampling distribution over logits [M, V]; each node
    takes `width` uniforms from its request's stream whatever it keeps, one read for all."""
    M = logits.shape[0]
    some = logits.isfinite().any(dim=-1, keepdim=True)  # [M, 1] False: the grammar or draft vocabulary left nothing
    q = adjusted_probs(logits.float().masked_fill(~some, 0.0), SamplingRows.build(
        [reqs[i].params for i, _ in nodes], logits.device), None) * some  # [M, V]
    owners: dict[int, list[int]] = {}  # row -> its nodes' indices into `nodes`
    for m, (i, _) in enumerate(nodes):
        owners.setdefault(i, []).append(m)
    counts = [len(ms) * width for ms in owners.values()]
    u = draw_uniforms([reqs[i].random_stream for i in owners], max(counts), logits.device, counts=counts)  # [R, C]
    at = [0] * (M * width)  # node m's j-th uniform: u's row of its owner, its slot's column j
    for r, ms in enumerate(owners.values()):
        for slot, m in enumerate(ms):
            for j in range(width):
                at[m * width + j] = r * u.shape[1] + slot * width + j
    u = u.reshape(-1).index_select(0, host_sync.upload(at, logits.device, torch.long)).view(M, width)  # [M, width]
    left, picks = q, []
    for j in range(width):
        x = inverse_cdf(left, u[:, j])  # [M]; meaningless once a row's support is spent (not kept)
        picks.append(x)
        left = left.scatter(1, x[:, None], 0.0)
    picks = torch.stack(picks, dim=1)  # [M, width]
    chances = q.gather(1, picks)  # [M, width]
    support = (q > 0).sum(dim=-1, keepdim=True)  # [M, 1]
    both = host_sync.read(torch.cat([picks.double(), chances.double(), support.double()], dim=-1))  # [M][2w + 1]
    for m, ((i, c), row) in enumerate(zip(nodes, both)):
        g = rows[i]
        planned = g.planned.get(c, 0) if c >= 0 else max(1, min(width, g.budget - g.depth + 1))
        n = min(planned, int(row[2 * width]), g.room)
        n = next((j for j in range(n) if not row[width + j] > 0), n)  # a rounding pick past the support ends it
        if n > 0:
            g.q_rows[c] = q[m]
            g.add_children(c, [math.log(v) for v in row[width:width + n]], [int(t) for t in row[:n]])


def _grammar_masks(reqs: list[Request], rows: list[_Growing], nodes: list[tuple[int, int]], vocab: int
                   ) -> torch.Tensor | None:
    """[M, V] bool: what each node's grammar allows after its path (nothing where the path leaves
    the grammar or ends it; everything on rows without one), or None where no row has a grammar."""
    if all(reqs[i].grammar is None for i, _ in nodes):
        return None
    bitmask = new_bitmask(len(nodes), vocab)  # [M, W]
    for m, (i, c) in enumerate(nodes):
        if reqs[i].grammar is not None and not _fill_after(reqs[i].grammar, rows[i].path(c), bitmask, m):
            bitmask[m] = 0
    return unpack_bitmask(bitmask, vocab)


def _fill_after(grammar: GrammarMatcher, path: list[int], bitmask: torch.Tensor, row: int) -> bool:
    """bitmask[row]: what the grammar allows after `path`; False where the path leaves the grammar
    or ends the request (no children). The grammar is left as it was."""
    walked = 0
    try:
        for token in path:
            if not grammar.accept(token):
                return False
            walked += 1
        if grammar.terminated:
            return False
        grammar.fill(bitmask, row)
        return True
    finally:
        grammar.rollback(walked)


def draft_trees_then_drop(kv, reqs: list[Request], bases: list[int], depths: list[int], budgets: list[int],
                          width: int, root_logits: torch.Tensor, feed: FeedFn) -> list[TokenTree | None]:
    """`draft_trees`, then each request's draft pool back to bases[i], its length before drafting:
    the tree's K/V goes (simpler than moving the accepted path's into place); the proposer's next
    catch-up feeds what the target accepted."""
    try:
        return draft_trees(reqs, depths, budgets, width, root_logits, feed)
    finally:
        kv.truncate_draft(reqs, bases)
