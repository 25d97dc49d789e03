"""The self-check: every decode step's predicted tokens and seconds by phase (draft, verify,
other), priced from the measured costs and acceptance estimates the plans read, kept next to what
the step realized and summed per (batch size, K chosen). Σpredicted ÷ Σrealized near 1 says the
prices the policy chooses by are right at that batch and K.

What a step is predicted to cost is what its plan prices: a one-K step (fixed, adaptive, a probe)
as SpecPolicy prices K (the padded (B, K + 1) verify pass, the time outside the passes at (B, K),
drafting at the rows a model drafts, at the first pass's expected width); a per-request step as
PerRequestPolicy does (the verify pass by its tokens, costs.PackedVerify); plain as the plain pass
and the time outside it. A round's long catch-up (a request its draft lags far behind) is
predicted in full in the step that pays it. A token tree is predicted as the chain of its depth
(the price the policy takes it at). Realized: the draft passes, the verify pass with its sampling
and acceptance, and the rest of the step (the proposer's own bookkeeping included), as the costs
record them; tokens, every token the step produced. Steps that also prefill or finish a request
are left out, as the cost tables leave them out: their time holds work no plan prices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.speculative.policy.costs import MeasuredCosts
from engine.speculative.policy.fits import interpolated
from engine.speculative.policy.k_choice import expected_tokens_table, first_pass_widths
from engine.speculative.policy.per_request import StepCost
from engine.speculative.proposers.base import CatchUp

PHASES = ("draft", "verify", "other")


@dataclass(frozen=True)
class Prediction:
    batch: int
    k: int  # the K chosen (a plan's widest row; 0: plain)
    tokens: float  # expected tokens the step produces
    seconds: dict[str, float]  # by phase (PHASES)


@dataclass(frozen=True)
class StepRecord:
    """One step's prediction and what it realized (`stats`: the step's DecodeStats)."""

    predicted: Prediction
    tokens: int
    seconds: dict[str, float]
    stats: object = None


@dataclass
class Totals:
    steps: int = 0
    predicted_tokens: float = 0.0
    realized_tokens: float = 0.0
    predicted: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    realized: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, record: StepRecord) -> None:
        self.steps += 1
        self.predicted_tokens += record.predicted.tokens
        self.realized_tokens += record.tokens
        for phase in PHASES:
            self.predicted[phase] += record.predicted.seconds[phase]
            self.realized[phase] += record.seconds[phase]


def ratio(predicted: float, realized: float) -> float | None:
    return predicted / realized if realized > 0 else None


def plain_prediction(costs: MeasuredCosts, batch: int) -> Prediction:
    """A plain step: one token a row, the plain pass and the time outside it."""
    return Prediction(batch, 0, float(batch), {"draft": 0.0, "verify": costs.verify_times(batch, 0)[0],
                                               "other": costs.other_times(batch, 0)[0]})


def round_prediction(costs: MeasuredCosts, ks: Sequence[int], rates: Sequence[Sequence[float]],
                     models: Sequence[bool], catch_up: CatchUp, catch_up_tokens: int = 0,
                     per_request: bool = False, packed: bool = True, chosen: int | None = None,
                     k_max: int | None = None) -> Prediction:
    """A round proposing ks[i] tokens for row i (max(ks) >= 1): rates[i] its acceptance by
    position, models[i] a model drafts it, catch_up_tokens the long catch-ups it pays first;
    priced as the per-request policy does (per_request) or as the one-K policy, whose lines are
    fitted over K up to k_max (the range it chose from; default max(ks)); kept under the K
    chosen (default: max(ks))."""
    batch, k = len(ks), max(ks)
    k_max = k if k_max is None else max(k, k_max)
    table = expected_tokens_table(rates, ks, k)  # E_i(0..k), held at E_i(k_i)
    widths = first_pass_widths(table, ks, catch_up)
    drafted = [kk for kk, m in zip(ks, models) if kk and m]
    depth = max(drafted, default=0)
    if per_request:
        total = batch + sum(ks)
        cost = StepCost(costs, batch, k, widths, packed)
        verify = cost.verify(total if packed else batch * (k + 1), k)
        base = cost.seconds(total, k)
        seconds = {"verify": verify, "other": base - verify,
                   "draft": cost.seconds(total, k, len(drafted), depth) - base if drafted else 0.0}
    else:
        seconds = {"verify": costs.verify_times(batch, k_max)[k], "other": costs.other_times(batch, k_max)[k],
                   "draft": 0.0}
        if drafted:
            first, further = costs.draft_times(len(drafted), k_max)
            seconds["draft"] = interpolated(first, widths[depth] - 1) + further[depth - 1]
    if catch_up_tokens:
        seconds["draft"] += costs.catch_up_time(catch_up_tokens)
    return Prediction(batch, k if chosen is None else chosen, sum(row[k] for row in table), seconds)


class SelfCheck:
    """Predictions kept until their step's realized figures arrive (`expect`, then `realize`),
    summed per (batch size, K chosen); `last` is the last step recorded."""

    def __init__(self):
        self.totals: dict[tuple[int, int], Totals] = {}
        self.pending: Prediction | None = None
        self.last: StepRecord | None = None

    def expect(self, prediction: Prediction) -> None:
        self.pending = prediction

    def realize(self, stats, draft: float, verify: float, other: float) -> StepRecord | None:
        """The pending prediction's step realized these (its DecodeStats, seconds by phase)."""
        predicted, self.pending = self.pending, None
        if predicted is None:
            return None
        record = StepRecord(predicted, stats.num_tokens, {"draft": draft, "verify": verify, "other": other}, stats)
        self.totals.setdefault((predicted.batch, predicted.k), Totals()).add(record)
        self.last = record
        return record

    def summary(self) -> list[dict]:
        """Per (batch, K chosen): steps, and Σpredicted, Σrealized and their ratio for tokens,
        step seconds and each phase's seconds (ratio None where nothing was realized)."""
        out = []
        for (batch, k), t in sorted(self.totals.items()):
            predicted, realized = sum(t.predicted.values()), sum(t.realized.values())
            row = {"batch": batch, "k": k, "steps": t.steps,
                   "tokens": {"predicted": t.predicted_tokens, "realized": t.realized_tokens,
                              "ratio": ratio(t.predicted_tokens, t.realized_tokens)},
                   "seconds": {"predicted": predicted, "realized": realized, "ratio": ratio(predicted, realized)}}
            for phase in PHASES:
                row[phase] = {"predicted": t.predicted[phase], "realized": t.realized[phase],
                              "ratio": ratio(t.predicted[phase], t.realized[phase])}
            out.append(row)
        return out
