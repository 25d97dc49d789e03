"""Choosing K (tokens to propose) each step from measured costs and estimated acceptance.

Paper §3.3-3.5 for one sequence: with acceptance rate a and K proposals a round yields
E(K) = (1 - a^(K+1)) / (1 - a) tokens and costs K draft steps plus one verify pass. For a
batch of B requests we maximise expected tokens per second:

    goodput(K) = sum_i E_i(min(K, k_max_i)) / (t_step + K * t_draft(B) + t_target(B, K + 1))
    goodput(0) = B / (t_step + t_target(B, 1))                          (plain decode)

with t_* read from a `CostModel` of measured forward times and t_step the engine's measured
per-step overhead outside the model passes. Because the verify pass stops
being nearly free as B grows (compute-bound), the best K falls to 0 at large batches by
itself and, since goodput is compared continuously, there is no cliff at a threshold. A
hysteresis margin keeps K from flipping between near-equal choices step to step.

Plain decode produces no new evidence about the proposer (its cost, its acceptance), so after
`probe_every` consecutive plain steps the policy takes one step with the best K > 0 ("probe"):
estimates that were too pessimistic, or a workload that changed, are noticed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

Reason = Literal["policy", "probe", "fixed", "disabled_batch_size", "length_guard", "no_proposal", "disabled"]


class Costs(Protocol):
    def target_time(self, batch: int, tokens_per_seq: int) -> float: ...
    def draft_time(self, batch: int) -> float: ...
    def step_overhead(self) -> float: ...


@dataclass
class AcceptanceEstimate:
    """Per-request estimate of the per-token acceptance rate a (rounds are truncated
    geometric: a = accepted / (accepted + rejections)), shrunk towards a prior."""

    accepted: int = 0
    rejections: int = 0

    def update(self, num_accepted: int, num_proposed: int) -> None:
        self.accepted += num_accepted
        self.rejections += int(num_accepted < num_proposed)

    def rate(self, prior: float, weight: float = 16.0) -> float:
        return (self.accepted + prior * weight) / (self.accepted + self.rejections + weight)


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per round] with k proposals at acceptance alpha (includes the final token)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class Choice:
    k: int
    reason: Reason
    goodput: dict[int, float]  # estimated tokens/s for each K considered (empty if not adaptive)


class SpecPolicy:
    def __init__(self, costs: Costs, spec_length: int, mode: Literal["fixed", "adaptive"],
                 disable_batch_size: int | None = None, hysteresis: float = 0.05,
                 prior_alpha: float = 0.6, probe_every: int = 32):
        self.costs = costs
        self.spec_length = spec_length
        self.mode = mode
        self.disable_batch_size = disable_batch_size
        self.hysteresis = hysteresis
        self.prior_alpha = prior_alpha
        self._last_k = spec_length
        self.probe_every = probe_every
        self._plain_streak = 0  # consecutive adaptive choices of K = 0

    def goodput(self, k: int, alphas: list[float], k_caps: list[int], draft_rows: int | None = None) -> float:
        """Expected tokens/s; draft_rows = requests drafted by the draft model (default all;
        n-gram proposals cost no model forward)."""
        batch = len(alphas)
        overhead = self.costs.step_overhead()
        if k == 0:
            return batch / (overhead + self.costs.target_time(batch, 1))
        tokens = sum(expected_tokens(a, min(k, cap)) for a, cap in zip(alphas, k_caps))
        draft_rows = batch if draft_rows is None else draft_rows
        draft = k * self.costs.draft_time(draft_rows) if draft_rows else 0.0
        return tokens / (overhead + draft + self.costs.target_time(batch, k + 1))

    def choose(self, alphas: list[float], k_caps: list[int], draft_rows: int | None = None) -> Choice:
        """alphas: estimated acceptance per request; k_caps: most each request may propose;
        draft_rows: how many of them the draft model would draft (None = all)."""
        batch = len(alphas)
        if self.disable_batch_size is not None and batch >= self.disable_batch_size:
            return Choice(0, "disabled_batch_size", {})
        k_max = min(self.spec_length, max(k_caps, default=0))
        if k_max <= 0:
            return Choice(0, "length_guard", {})
        if self.mode == "fixed":
            return Choice(k_max, "fixed", {})
        scores = {k: self.goodput(k, alphas, k_caps, draft_rows) for k in range(k_max + 1)}
        best = max(scores, key=scores.get)
        last = min(self._last_k, k_max)
        if scores[last] >= (1.0 - self.hysteresis) * scores[best]:
            best = last
        self._last_k = best
        if best == 0:
            self._plain_streak += 1
            if self._plain_streak >= self.probe_every:
                self._plain_streak = 0
                probe = max(range(1, k_max + 1), key=scores.get)
                return Choice(probe, "probe", scores)
        else:
            self._plain_streak = 0
        return Choice(best, "policy", scores)
