"""A K per request (SpecConfig.k_per_request): verify tokens go where they are expected to be
accepted. Each request's next draft position survives with probability s_ij = h_i1 ... h_ij (its
acceptance rates by position); a packed verify pass costs by the batch's total tokens, drafting by
the rows drafted and the deepest. Greedy marginal allocation: positions are taken in order of
their survival (within a row that is position order), and the allocation kept is the prefix of
that order with the most expected tokens per second, the empty prefix (plain decoding) included.

Probes carry over from the one-K policy (k_choice.SpecPolicy), per request: a request held at
K = 0 for `probe_every` allocations is given PROBE_K once (a few a step, the longest held first), so its estimate follows its text (each
probe that leaves it at 0 doubles its wait, up to MAX_PROBE_BACKOFF times); after as many
speculative steps in a row, one step decodes plainly to re-measure the plain pass. Between plain
and speculation the hysteresis margin keeps the side the last step took while within it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.speculative.policy.costs import MeasuredCosts, interpolated
from engine.speculative.policy.k_choice import first_pass_widths
from engine.speculative.proposers.base import CatchUp

PROBE_K = 2  # tokens a probed request proposes
MAX_PROBE_BACKOFF = 8
PROBE_ROWS = 8  # at most one request probed a step per this many rows


@dataclass(frozen=True)
class Allocation:
    ks: list[int]  # what each request proposes (0: it decodes one token, riding along)
    reason: str  # "policy", "probe" (a request was probed) or "plain_probe"
    rate: float  # the chosen allocation's expected tokens per second
    plain_rate: float  # plain decoding's


class StepCost:
    """A decode step's seconds for an allocation, from the measured costs: the verify pass by the
    tokens it computes (packed: the batch's total), the step's other work at the same tokens, the draft passes by rows drafted
    (priced at the next power-of-two rows) and depth."""

    def __init__(self, costs: MeasuredCosts, batch: int, k_max: int, drafts: bool, widths: list[float],
                 packed: bool = True):
        self.costs, self.batch, self.k_max, self.drafts, self.widths = costs, batch, k_max, drafts, widths
        self.packed = packed  # False: a pass computes batch x (depth + 1) tokens
        self.other = costs.other_times(batch, k_max)  # [k_max + 1]
        self._draft: dict[int, tuple[list[float], list[float]]] = {}

    def seconds(self, total_tokens: int, rows_drafted: int, depth: int) -> float:
        if not self.packed:
            total_tokens = self.batch * (depth + 1)
        per_row = total_tokens / self.batch - 1.0  # the padded K of the same tokens
        t = self.costs.packed_verify_time(self.batch, total_tokens) + interpolated(self.other, min(per_row, self.k_max))
        if depth and self.drafts:
            first, further = self._draft_times(rows_drafted)
            t += interpolated(first, self.widths[depth] - 1) + further[depth - 1]
        return t

    def _draft_times(self, rows: int) -> tuple[list[float], list[float]]:
        rows = min(self.batch, 1 << max(0, (rows - 1).bit_length()))
        if rows not in self._draft:
            self._draft[rows] = self.costs.draft_times(rows, self.k_max)
        return self._draft[rows]


def survival(rates: Sequence[float], cap: int) -> list[float]:
    """s_1..s_cap: the chance the first j proposals are all accepted (rates by position)."""
    out, p = [], 1.0
    for h in rates[:cap]:
        p *= h
        out.append(p)
    return out


def allocate(rates: list[Sequence[float]], caps: list[int], cost: StepCost) -> tuple[list[int], float, float]:
    """(ks, rate, plain rate): the non-empty prefix of the survival order with the most expected
    tokens per second (ks all 0 and rate 0 when no request may propose), and plain decoding's rate."""
    batch = len(caps)
    order = sorted(((s, i, j) for i, (r, c) in enumerate(zip(rates, caps)) for j, s in enumerate(survival(r, c), 1)),
                   key=lambda x: (-x[0], x[2]))
    ks = [0] * batch
    best, best_rate, expected, drafted, depth = 0, 0.0, float(batch), 0, 0
    for n, (s, i, j) in enumerate(order, 1):
        drafted += ks[i] == 0
        ks[i] = j
        depth, expected = max(depth, j), expected + s
        rate = expected / cost.seconds(batch + n, drafted, depth)
        if rate > best_rate:
            best, best_rate = n, rate
    ks = [0] * batch
    for _, i, j in order[:best]:
        ks[i] = j
    return ks, best_rate, batch / cost.seconds(batch, 0, 0)


class PerRequestPolicy:
    def __init__(self, costs: MeasuredCosts, probe_every: int = 32, hysteresis: float = 0.03):
        self.costs, self.probe_every, self.hysteresis = costs, probe_every, hysteresis
        self._held: dict[str, int] = {}  # request -> allocations in a row at K = 0
        self._wait: dict[str, int] = {}  # request -> allocations at 0 before its next probe
        self._speculated = 0  # speculative steps in a row
        self._plain_wait = probe_every
        self._was_plain = False

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        self._wait.pop(request_id, None)

    def choose(self, ids: list[str], rates: list[Sequence[float]], caps: list[int], k_max: int, drafts: bool,
               catch_up: CatchUp, packed: bool = True) -> Allocation:
        """ids, rates (by position, k_max of them) and caps (most each may propose) per request;
        drafts: a model drafts the rows that propose (False: a lookup, no passes); packed: verify
        passes compute only the real tokens (False: every row padded to the widest)."""
        caps = [min(c, k_max) for c in caps]
        table = [[1.0] + [1.0 + sum(survival(r, min(c, k))) for k in range(1, k_max + 1)] for r, c in zip(rates, caps)]
        cost = StepCost(self.costs, len(ids), k_max, drafts, first_pass_widths(table, caps, catch_up), packed)
        ks, rate, plain = allocate(rates, caps, cost)
        margin = (1.0 + self.hysteresis) if self._was_plain else 1.0 / (1.0 + self.hysteresis)
        if rate < margin * plain:  # plain decoding, unless speculation wins by the margin (or loses within it)
            ks, self._plain_wait = [0] * len(ids), self.probe_every
        return self._probed(ids, ks, caps, rate, plain)

    def _probed(self, ids: list[str], ks: list[int], caps: list[int], rate: float, plain: float) -> Allocation:
        """Per-request probes (at most one a PROBE_ROWS rows, those held at 0 longest) and the plain
        probe (module docstring) applied to the allocation."""
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
        for i in due[:max(1, len(ids) // PROBE_ROWS)]:
            ks[i], rid = min(PROBE_K, caps[i]), ids[i]
            self._held[rid], self._wait[rid] = 0, min(2 * self._wait[rid], MAX_PROBE_BACKOFF * self.probe_every)
        self._speculated = 0 if self._was_plain else self._speculated + 1
        if not due and self._speculated >= self._plain_wait:
            self._speculated, self._plain_wait = 0, min(2 * self._plain_wait, MAX_PROBE_BACKOFF * self.probe_every)
            return Allocation([0] * len(ids), "plain_probe", rate, plain)
        return Allocation(ks, "probe" if due else "policy", rate, plain)
