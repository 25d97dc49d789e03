"""A K per request (SpecConfig.k_per_request): verify tokens go where they are expected to be
accepted. Each request's next draft position survives with probability s_ij = h_i1 ... h_ij (its
acceptance rates by position). A step's price: the verify pass by its tokens and its widest row
(costs.PackedVerify), drafting by the rows a model drafts and the deepest, a far-behind request's
catch-up spread over its rounds left. Greedy marginal allocation: positions are taken in order of
their survival (within a row that is position order), and the allocation kept is the prefix of
that order with the most expected tokens per second, the empty prefix (plain decoding) included.

Probes carry over from the one-K policy (k_choice.SpecPolicy): while others speculate, a request
held at K = 0 for `probe_every` allocations is given PROBE_K once (a few a step, the longest held
first; each probe that leaves it at 0 doubles its wait, up to MAX_PROBE_BACKOFF times); a batch
decoding plainly probes one request at a time on the same schedule; after as many speculative
steps in a row, one step decodes plainly to re-measure the plain pass. Between plain and
speculation the hysteresis margin keeps the side the last step took while within it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from engine.speculative.policy.costs import MeasuredCosts, PackedVerify
from engine.speculative.policy.fits import interpolated
from engine.speculative.policy.k_choice import first_pass_widths
from engine.speculative.proposers.base import CatchUp

PROBE_K = 2  # tokens a probed request proposes
MAX_PROBE_BACKOFF = 8
PROBE_ROWS = 8  # at most one request probed a step per this many rows
REUSE_PLAIN = 8  # an all-plain verdict is reused for this many steps of the same batch (no new rounds)
TRIED_ROUNDS = 1  # a request proposes one position past those judged in this many of its rounds (0: no limit)


@dataclass(frozen=True)
class BatchView:
    """The decode batch as the policy reads it, one entry a request: what `reuse` compares (cheap
    to gather) and where the caps are clipped (`allowed`)."""

    ids: list[str]
    caps: list[int]  # the most each may propose: its KV room, max_tokens budget and own spec_length
    k_max: int  # spec_length
    tried: list[int] | None = None  # leading positions judged in TRIED_ROUNDS of its rounds (None: no limit)
    version: object = None  # the acceptance estimates' (an all-plain verdict is reused while unchanged)

    def allowed(self) -> list[int]:
        """Each request's cap, clipped here only: at k_max, and (tried given) one position past
        those judged, at least PROBE_K: a deeper position's rate is only borrowed from the last."""
        caps = [min(c, self.k_max) for c in self.caps]
        if self.tried is None:
            return caps
        return [min(c, max(PROBE_K, t + 1)) for c, t in zip(caps, self.tried, strict=True)]


@dataclass(frozen=True)
class RowPrices:
    """What prices each request's positions (`choose`), gathered only when a verdict is not reused."""

    rates: list[Sequence[float]]  # acceptance by position, k_max of them
    drafts: list[bool]  # a model drafts for it when it proposes (False: a lookup, no passes)
    catch_up: CatchUp = "own"  # what the model proposer's first pass feeds
    packed: bool = True  # verify passes compute only the real tokens (False: every row padded to the widest)
    catch_ups: list[float] | None = None  # seconds the draft needs to catch up on it first (a long lag)
    tokens_left: list[int] | None = None  # tokens it has left (a catch-up is spread over its rounds)


@dataclass(frozen=True)
class Allocation:
    ks: list[int]  # what each request proposes (0: it decodes one token, riding along)
    reason: str  # "policy", "probe" (a request was probed) or "plain_probe"
    rate: float  # the chosen allocation's expected tokens per second
    plain_rate: float  # plain decoding's


class StepCost:
    """A decode step's seconds for an allocation, from the measured costs: the verify pass by the
    tokens it computes (packed: the batch's total), the step's other work at the same tokens, the
    draft passes by rows drafted (between one row's and the batch's) and depth. Tables are read
    once a step: the policy prices many allocations with them."""

    def __init__(self, costs: MeasuredCosts, batch: int, k_max: int, widths: list[float], packed: bool = True):
        self.costs, self.batch, self.k_max, self.widths = costs, batch, k_max, widths
        self.packed = packed  # False: a pass computes batch x (depth + 1) tokens
        self.verify = PackedVerify(costs, batch, k_max)
        self.other = costs.other_times(batch, k_max)  # [k_max + 1]
        self._draft: dict[int, list[float]] = {}  # rows -> seconds of drafting at depth 0..k_max

    def seconds(self, total_tokens: int, depth: int, rows_drafted: int = 0, draft_depth: int = 0) -> float:
        """A step verifying `total_tokens` (its widest row depth + 1), a model drafting
        `rows_drafted` rows to `draft_depth`."""
        if not self.packed:
            total_tokens = self.batch * (depth + 1)
        t = self.verify(total_tokens, depth) + interpolated(self.other, min(total_tokens / self.batch - 1.0, self.k_max))
        if rows_drafted:
            t += self._drafting(rows_drafted)[draft_depth]
        return t

    def _drafting(self, rows: int) -> list[float]:
        """Drafting seconds at depth 0..k_max for `rows` rows: linear between one row and the batch."""
        if not self._draft:
            for n in {1, self.batch}:
                first, further = self.costs.draft_times(n, self.k_max)
                self._draft[n] = [0.0] + [interpolated(first, self.widths[d] - 1) + further[d - 1]
                                          for d in range(1, self.k_max + 1)]
        one, full = self._draft[1], self._draft[self.batch]
        if rows >= self.batch or self.batch == 1:
            return full
        share = (rows - 1) / (self.batch - 1)
        return [a + (b - a) * share for a, b in zip(one, full)]


def survival(rates: Sequence[float], cap: int) -> list[float]:
    """s_1..s_cap: the chance the first j proposals are all accepted (rates by position)."""
    out, p = [], 1.0
    for h in rates[:cap]:
        p *= h
        out.append(p)
    return out


def allocate(survivals: list[list[float]], cost: StepCost, drafts: Sequence[bool] | None = None,
             catch_ups: Sequence[float] | None = None) -> tuple[list[int], float, float]:
    """(ks, rate, plain rate): the non-empty prefix of the survival order (survivals[i]: request
    i's s_1.., up to its cap) with the most expected tokens per second (ks all 0 and rate 0 when
    no request may propose), and plain decoding's rate. drafts[i]: a model drafts for request i
    (default: all); catch_ups[i]: seconds it needs to catch up on request i first."""
    batch = len(survivals)
    drafts = drafts if drafts is not None else [True] * batch
    catch_ups = catch_ups or [0.0] * batch
    order = sorted(((s, i, j) for i, row in enumerate(survivals) for j, s in enumerate(row, 1)),
                   key=lambda x: (-x[0], x[2]))
    ks = [0] * batch
    best, best_rate, expected, depth, drafted, draft_depth, behind = 0, 0.0, float(batch), 0, 0, 0, 0.0
    for n, (s, i, j) in enumerate(order, 1):
        if ks[i] == 0 and drafts[i]:
            drafted, behind = drafted + 1, behind + catch_ups[i]
        if drafts[i]:
            draft_depth = max(draft_depth, j)
        ks[i] = j
        depth, expected = max(depth, j), expected + s
        rate = expected / (cost.seconds(batch + n, depth, drafted, draft_depth) + behind)
        if rate > best_rate:
            best, best_rate = n, rate
    ks = [0] * batch
    for _, i, j in order[:best]:
        ks[i] = j
    return ks, best_rate, batch / cost.seconds(batch, 0)


class PerRequestPolicy:
    def __init__(self, costs: MeasuredCosts, probe_every: int = 32, hysteresis: float = 0.03):
        self.costs, self.probe_every, self.hysteresis = costs, probe_every, hysteresis
        self._held: dict[str, int] = {}  # request -> allocations in a row at K = 0
        self._wait: dict[str, int] = {}  # request -> allocations at 0 before its next probe
        self._speculated = 0  # speculative steps in a row
        self._plain_wait = probe_every
        self._was_plain = False
        self._plain_streak, self._batch_wait = 0, probe_every  # all-plain verdicts in a row; before a probe
        self._last: tuple[tuple, float] | None = None  # what the last all-plain verdict was judged on, its rate
        self._reused = 0  # verdicts taken from it since it was computed

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        self._wait.pop(request_id, None)

    def reuse(self, view: BatchView) -> Allocation | None:
        """The last all-plain verdict again, for up to REUSE_PLAIN steps, where nothing it was
        judged on has changed (the batch, its room, the estimates' version) but the costs, a
        little; None: choose afresh."""
        caps = view.allowed()
        if self._last is None or self._last[0] != (tuple(view.ids), tuple(caps), view.version) \
                or self._reused >= REUSE_PLAIN:
            return None
        self._reused += 1
        return self._probed(view.ids, [0] * len(caps), caps, 0.0, self._last[1])

    def choose(self, view: BatchView, prices: RowPrices) -> Allocation:
        """Each request's K within view.allowed(), from its acceptance rates (prices.rates), by
        the verify pass's tokens, the draft passes of the rows a model drafts (prices.drafts) and
        a long catch-up's seconds, paid once and so spread over the rounds the request has left
        (tokens_left, at its expected tokens a round)."""
        caps, k_max, n = view.allowed(), view.k_max, len(view.ids)
        survivals = [survival(r, c) for r, c in zip(prices.rates, caps, strict=True)]
        table = [[1.0, *accumulate(row + [0.0] * (k_max - len(row)), initial=1.0)][1:] for row in survivals]
        cost = StepCost(self.costs, n, k_max, first_pass_widths(table, caps, prices.catch_up), prices.packed)
        catch_ups = prices.catch_ups
        if catch_ups is not None:
            left = prices.tokens_left or [1] * n
            catch_ups = [c / max(1.0, t / (1.0 + sum(sv))) for c, t, sv in zip(catch_ups, left, survivals)]
        ks, rate, plain = allocate(survivals, cost, prices.drafts, catch_ups)
        margin = (1.0 + self.hysteresis) if self._was_plain else 1.0 / (1.0 + self.hysteresis)
        if rate < margin * plain:  # plain decoding, unless speculation wins by the margin (or loses within it)
            ks, self._plain_wait = [0] * n, self.probe_every
        key = (tuple(view.ids), tuple(caps), view.version)
        self._last, self._reused = ((key, plain), 0) if not any(ks) else (None, 0)
        return self._probed(view.ids, ks, caps, rate, plain)

    def _probed(self, ids: list[str], ks: list[int], caps: list[int], rate: float, plain: float) -> Allocation:
        """Probes (module docstring) applied to the allocation: in a speculative step, the requests
        held at 0 long enough (at most one a PROBE_ROWS rows, the longest held first); after a
        run of all-plain verdicts, the one held longest; after a run of speculative ones, a plain step."""
        self._was_plain = not any(ks)
        due = []
        for i, rid in enumerate(ids):
            if ks[i]:
                self._held[rid], self._wait[rid] = 0, self.probe_every  # given K on its merits
            elif caps[i]:
                self._held[rid] = self._held.get(rid, 0) + 1
                if self._held[rid] >= self._wait.setdefault(rid, self.probe_every):
                    due.append(i)
        due.sort(key=lambda i: -self._held[ids[i]])
        if self._was_plain:
            self._plain_streak += 1
            due = [max((i for i, c in enumerate(caps) if c), key=lambda i: self._held[ids[i]])] \
                if self._plain_streak >= self._batch_wait and any(caps) else []
            if due:
                self._plain_streak, self._batch_wait = 0, min(2 * self._batch_wait, MAX_PROBE_BACKOFF * self.probe_every)
                self._last = None  # the probe's round is new evidence: judge afresh
        else:
            self._plain_streak, self._batch_wait = 0, self.probe_every
        for i in due[:max(1, len(ids) // PROBE_ROWS)]:
            ks[i], rid = min(PROBE_K, caps[i]), ids[i]
            self._held[rid], self._wait[rid] = 0, min(2 * self._wait[rid], MAX_PROBE_BACKOFF * self.probe_every)
        self._speculated = 0 if self._was_plain else self._speculated + 1
        if not due and self._speculated >= self._plain_wait:
            self._speculated, self._plain_wait = 0, min(2 * self._plain_wait, MAX_PROBE_BACKOFF * self.probe_every)
            return Allocation([0] * len(ids), "plain_probe", rate, plain)
        return Allocation(ks, "probe" if due else "policy", rate, plain)
