"""Suffix decoding (Oliaro et al., NeurIPS 2025): proposals from what the server has already said.

A `SuffixCache` keeps the outputs of finished requests, at most `max_tokens` of them (the oldest
requests evicted first), apart per sharing scope; the request's own prompt and output so far are
searched beside it. A draft from a text: the recent occurrences of the context's longest suffix
(at least two tokens) and the tree of the tokens that followed them, each node scored by the share
of the occurrences that went on through it (an estimate of its acceptance). Nodes are kept best
first down to MIN_PROB, at most match length x a factor of them (the paper's rule: a longer
match is stronger evidence, so it may propose more). Of the drafts from the request's own text and
from the cache, the one with the higher score (expected accepted tokens) is proposed.

Proposals are chosen, not drawn: each node is a point mass, exact through the token rule for
chains and the tree rule (engine/speculative/tree.py), as prompt lookup's are.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from engine.request import Request
from engine.speculative.proposers.base import LONG_CATCH_UP, Proposal, Proposer, one_hot_q
from engine.token_tree import TokenTree

SEPARATOR = -1  # before every stored text: no match or continuation crosses from one into the next
MIN_MATCH = 2  # a match is at least a bigram (the index's key)
MAX_MATCH = 24  # the longest suffix matched (the paper's tree depth)
MIN_PROB = 0.1  # the least score a proposed node may have
SPEC_FACTOR = 1.0  # a match of m tokens proposes at most m x this many nodes
ALONE_SPEC_FACTOR = 2.0  # ... in a batch of at most ALONE_BATCH requests, where a wider verify pass is nearly free
ALONE_BATCH = 4  # (performance-notes#suffix-decoding-2026-11-28)
MAX_OCCURRENCES = 64  # the most recent occurrences a draft counts
KEY_SPAN = 1 << 24  # bigram key: first token x KEY_SPAN + second (token ids < 2^24)


@dataclass(frozen=True)
class SuffixDraft:
    tree: TokenTree
    score: float  # expected accepted tokens by the scores: the sum of the nodes' scores
    match: int  # tokens of the context matched


@dataclass(frozen=True)
class DraftLimits:
    depth: int  # most tokens a draft reaches past the context
    max_nodes: int
    width: int  # most children a node may have (1: a chain)
    min_match: int = MIN_MATCH  # the shortest match a draft is grown from
    factor: float = SPEC_FACTOR  # a match of m tokens proposes at most m x factor nodes

    def nodes(self, match: int) -> int:
        """Most nodes a match of this many tokens may propose."""
        return min(self.max_nodes, int(match * self.factor + 1e-6))


def match_sets(text: np.ndarray, ends: np.ndarray, context: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """text [L] (SEPARATOR first and between texts), ends: the positions in text where the
    context's last MIN_MATCH tokens end -> (m, the positions where its last m tokens end) for the
    longest m of each distinct set of positions, longest first."""
    out: list[tuple[int, np.ndarray]] = []
    m, limit = MIN_MATCH, min(MAX_MATCH, len(context))
    while len(ends):
        if m == limit:
            out.append((m, ends))
            break
        longer = ends[text[ends - m] == context[-1 - m]]  # text[0] is SEPARATOR: never below 0
        if len(longer) < len(ends):
            out.append((m, ends))
        ends, m = longer, m + 1
    return out[::-1]


def continuation_trie(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """rows [n, D] (what followed each occurrence, SEPARATOR past a text's end) -> the rows sorted,
    starts [n, D] (sorted row i opens a node at depth d: its first d + 1 tokens differ from the
    row before's), node [n, D] (each row's node id at each depth) and counts [nodes] (rows through
    each node): the trie of the rows at once."""
    n, depth = rows.shape
    rows = rows[np.lexsort(rows.T[::-1])]
    starts = np.ones((n, depth), dtype=bool)
    starts[1:] = np.logical_or.accumulate(rows[1:] != rows[:-1], axis=1)
    per_depth = starts.sum(axis=0)  # [D]
    node = np.cumsum(starts, axis=0) - 1 + (np.cumsum(per_depth) - per_depth)
    return rows, starts, node, np.bincount(node.ravel(), minlength=int(per_depth.sum()))


def grow_draft(text: np.ndarray, ends: np.ndarray, match: int, limits: DraftLimits) -> SuffixDraft | None:
    """The tree of what followed the most recent MAX_OCCURRENCES of `ends` in text, a node's score
    being the share of occurrences continuing through it: the best nodes first, each with its
    parent, at most `limits.width` children a node, scores >= MIN_PROB."""
    max_nodes = limits.nodes(match)
    depth = min(limits.depth, max_nodes)
    ends = ends[-MAX_OCCURRENCES:]
    n = len(ends)
    if depth <= 0 or n == 0:
        return None
    at = ends[:, None] + 1 + np.arange(depth)  # [n, D]
    rows = np.where(at < len(text), text[np.minimum(at, len(text) - 1)], SEPARATOR)  # [n, D]
    rows[np.maximum.accumulate(rows < 0, axis=1)] = SEPARATOR  # nothing after a text's end
    rows, starts, node, counts = continuation_trie(rows)
    good = starts & (rows >= 0) & (counts[node] >= MIN_PROB * n)  # [n, D] the first row of each node worth proposing
    d, r = np.nonzero(good.T)  # by depth, then row
    if not len(r):
        return None
    ids = node[r, d]
    parents = np.where(d > 0, node[r, np.maximum(d - 1, 0)], -1)
    kept: dict[int, int] = {}  # node -> its index in the draft
    children: dict[int, int] = {}  # draft index (-1: root) -> children kept
    tokens, draft_parents, score = [], [], 0.0
    for j in np.lexsort((d, -counts[ids])).tolist():  # best first; ties: shallower (a parent before its child)
        i, parent = int(ids[j]), int(parents[j])
        at_parent = kept.get(parent, -2) if parent >= 0 else -1
        if at_parent == -2 or children.get(at_parent, 0) >= limits.width:
            continue
        kept[i] = len(tokens)
        children[at_parent] = children.get(at_parent, 0) + 1
        tokens.append(int(rows[r[j], d[j]]))
        draft_parents.append(at_parent)
        score += counts[i] / n
        if len(tokens) >= max_nodes:
            break
    return SuffixDraft(TokenTree(tuple(tokens), tuple(draft_parents)), score, match)


def best_draft(text: np.ndarray, ends: np.ndarray, context: np.ndarray, limits: DraftLimits) -> SuffixDraft | None:
    """The best-scored draft over the context's matches of at least limits.min_match tokens in
    text (ties: the longer match)."""
    best = None
    for m, at in match_sets(text, ends, context):
        if m < limits.min_match or (best is not None and best.score >= limits.nodes(m)):
            break  # (a shorter match proposes fewer nodes: it cannot score more)
        draft = grow_draft(text, at, m, limits)
        if draft is not None and (best is None or draft.score > best.score):
            best = draft
    return best


def own_text_draft(context: np.ndarray, limits: DraftLimits) -> SuffixDraft | None:
    """A draft from the request's own text: the context [L] searched in itself."""
    if len(context) < MIN_MATCH + 1:
        return None
    text = np.concatenate(([SEPARATOR], context))  # context[i] at text[i + 1]
    # bigram ends e in 2..L - 1: text[e - 1], text[e] == the context's last two (e = L: the context's own end)
    ends = np.flatnonzero((text[1:-2] == context[-2]) & (text[2:-1] == context[-1])) + 2
    return best_draft(text, ends, context, limits)


class _Texts:
    """The texts of one sharing scope, oldest first, in one array (each after a SEPARATOR), and a
    bigram index: sorted runs of (key, the absolute position where the bigram ends), each run
    newer than the one before, merged when a run grows as large as the one before it (adding a
    text costs O(log N) a token). Forgetting the oldest text moves `live` past it; the array and
    the runs drop what is dead once it outweighs what lives (O(1) a token)."""

    def __init__(self) -> None:
        self.buffer = np.full(1024, SEPARATOR, dtype=np.int32)
        self.size = 0  # tokens in buffer (dead ones included)
        self.base = 0  # the absolute position of buffer[0]
        self.live = 0  # the absolute position where the oldest kept text starts
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []  # (keys [R], ends [R]) sorted by key, then end
        self.spans: deque[tuple[int, int]] = deque()  # each kept text's [start, end) (absolute, SEPARATOR first)

    def add(self, tokens: list[int]) -> None:
        start = self.base + self.size
        chunk = np.asarray([SEPARATOR, *tokens], dtype=np.int32)
        if self.size + len(chunk) > len(self.buffer):
            grown = np.full(max(2 * len(self.buffer), self.size + len(chunk)), SEPARATOR, dtype=np.int32)
            grown[:self.size] = self.buffer[:self.size]
            self.buffer = grown
        self.buffer[self.size:self.size + len(chunk)] = chunk
        self.size += len(chunk)
        self.spans.append((start, start + len(chunk)))
        if len(tokens) < 2:
            return
        pairs = chunk[1:].astype(np.int64)
        keys = pairs[:-1] * KEY_SPAN + pairs[1:]
        ends = start + 2 + np.arange(len(keys), dtype=np.int64)  # chunk[1 + j + 1] ends pair j
        order = np.argsort(keys, kind="stable")
        self.runs.append((keys[order], ends[order]))
        while len(self.runs) > 1 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0]):
            (k_old, e_old), (k_new, e_new) = self.runs[-2], self.runs.pop()
            keys = np.concatenate((k_old, k_new))
            order = np.argsort(keys, kind="stable")  # the older run's ends first within a key
            self.runs[-1] = (keys[order], np.concatenate((e_old, e_new))[order])

    def drop_oldest(self) -> int:
        """Forgets the oldest text; its tokens."""
        start, end = self.spans.popleft()
        self.live = end
        if self.live - self.base > self.size // 2:  # the dead part outweighs the living: drop it
            cut = self.live - self.base
            self.buffer = self.buffer[cut:].copy()
            self.size -= cut
            self.base = self.live
            self.runs = [(k[e >= self.live], e[e >= self.live]) for k, e in self.runs]
            self.runs = [run for run in self.runs if len(run[0])]
        return end - start - 1

    def draft(self, context: np.ndarray, limits: DraftLimits) -> SuffixDraft | None:
        key = int(context[-2]) * KEY_SPAN + int(context[-1])
        found = []
        for keys, ends in self.runs:  # oldest first: positions come out ascending
            lo, hi = np.searchsorted(keys, (key, key + 1))
            if lo < hi:
                found.append(ends[lo:hi])
        if not found:
            return None
        ends = np.concatenate(found) if len(found) > 1 else found[0]
        ends = ends[ends >= self.live + 2] - self.live  # kept texts only, from the oldest's SEPARATOR
        if not len(ends):
            return None
        return best_draft(self.buffer[self.live - self.base:self.size], ends, context, limits)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes + sum(k.nbytes + e.nbytes for k, e in self.runs)


class SuffixCache:
    """Finished requests' outputs, at most max_tokens in all (the oldest evicted first), kept apart
    per scope (a request's draft reads its own scope's texts only)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._scopes: dict[str, _Texts] = {}
        self._order: deque[str] = deque()  # the scope of each stored text, oldest first

    def add(self, scope: str, tokens: list[int]) -> None:
        """Stores a finished output (longer than max_tokens: its last max_tokens)."""
        if self.max_tokens == 0 or len(tokens) < MIN_MATCH:
            return
        tokens = tokens[-self.max_tokens:]
        self._scopes.setdefault(scope, _Texts()).add(tokens)
        self._order.append(scope)
        self.num_tokens += len(tokens)
        self.evict(self.max_tokens)

    def evict(self, max_tokens: int) -> None:
        """Forgets the oldest texts until at most max_tokens are kept."""
        self.max_tokens = max_tokens
        while self.num_tokens > max_tokens:
            scope = self._order.popleft()
            texts = self._scopes[scope]
            self.num_tokens -= texts.drop_oldest()
            if not texts.spans:
                del self._scopes[scope]

    def draft(self, scope: str, context: np.ndarray, limits: DraftLimits) -> SuffixDraft | None:
        texts = self._scopes.get(scope)
        if texts is None or len(context) < MIN_MATCH:
            return None
        return texts.draft(context, limits)

    @property
    def num_texts(self) -> int:
        return len(self._order)

    @property
    def nbytes(self) -> int:
        """Bytes the stored texts and their index take (arrays only)."""
        return sum(t.nbytes for t in self._scopes.values())


class SuffixProposer(Proposer):
    name = "suffix"
    runs_model = False
    drafts_trees = True
    learns = True
    catch_up = "own"
    long_catch_up = LONG_CATCH_UP  # a lookup never catches up

    def __init__(self, cache: SuffixCache, sharing: str, vocab_size: int, device, min_match: int = MIN_MATCH):
        self.cache = cache
        self.sharing = sharing  # "all": every request's outputs inform every request; "tenant": the same tenant's only
        self.vocab_size = vocab_size
        self.device = device
        self.min_match = min_match

    def scope(self, request: Request) -> str | None:
        """The cache scope a request reads and joins; None: neither (a request without a tenant
        when outputs are shared per tenant)."""
        if self.sharing == "all":
            return ""
        return None if request.params.tenant is None else f"tenant:{request.params.tenant}"

    def limits(self, batch: int, depth: int, max_nodes: int, width: int) -> DraftLimits:
        """A draft's limits in a batch of this many requests: a match may propose more per matched
        token where the verify pass is nearly free (a small batch); in a larger one every row's
        pass widens to the longest proposal."""
        return DraftLimits(depth, max_nodes, width, self.min_match,
                           ALONE_SPEC_FACTOR if batch <= ALONE_BATCH else SPEC_FACTOR)

    def draft(self, request: Request, limits: DraftLimits) -> SuffixDraft | None:
        if limits.depth <= 0 or limits.max_nodes <= 0:
            return None
        context = np.asarray(request.all_token_ids, dtype=np.int64)
        own = own_text_draft(context, limits)
        scope = self.scope(request)
        shared = None if scope is None else self.cache.draft(scope, context[-(MAX_MATCH + 1):], limits)
        if own is None or (shared is not None and shared.score > own.score):
            return shared
        return own

    def propose(self, requests: list[Request], ks: list[int], with_q: bool) -> Proposal:
        drafts = [self.draft(r, self.limits(len(requests), k, k, 1)) for r, k in zip(requests, ks)]
        tokens = [list(d.tree.tokens) if d is not None else [] for d in drafts]
        q = one_hot_q(tokens, self.vocab_size, self.device) if with_q else None
        return Proposal(tokens, q, [self.name if t else "none" for t in tokens])

    def propose_trees(self, requests: list[Request], depths: list[int], budgets: list[int],
                      width: int) -> list[TokenTree | None]:
        """A tree per request: depth at most depths[i], at most budgets[i] nodes (None: no match)."""
        drafts = [self.draft(r, self.limits(len(requests), d, b, width)) for r, d, b in zip(requests, depths, budgets)]
        return [d.tree if d is not None else None for d in drafts]

    def learn(self, request: Request) -> None:
        """Stores a finished request's output, unless it opted out of speculation."""
        scope = self.scope(request)
        if scope is not None and request.params.spec_length != 0:
            self.cache.add(scope, request.output_token_ids)

    def lag(self, requests: list[Request]) -> list[int]:
        return [0] * len(requests)
