"""Measured forward-pass times, for the adaptive policy: exponential moving averages per
(batch bucket = next power of two, tokens per sequence), interpolated between buckets;
`calibrate` fills them at start-up.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from typing import Protocol

from engine.kv import CachePool
from engine.model.llama import Llama
from engine.model.passes import fill_slots, time_pass


def smoothed(old: float | None, new: float, smoothing: float) -> float:
    """Exponential moving average step: `new` alone when there is no `old` yet."""
    return new if old is None else (1 - smoothing) * old + smoothing * new


def batch_bucket(batch: int) -> int:
    return 1 << max(0, (batch - 1).bit_length())


class TimingTable:
    """weight(batch, T): how much an entry is to be trusted against the other T of its batch
    bucket: every observation in the bucket decays the bucket's weights by `weight_decay` and
    adds 1 to the observed entry's, so entries measured recently and often outweigh those
    last measured long ago (at start-up calibration, over a short context)."""

    def __init__(self, smoothing: float = 0.2, weight_decay: float = 0.98):
        self.smoothing = smoothing
        self.weight_decay = weight_decay
        self._ema: dict[int, dict[int, float]] = defaultdict(dict)  # tokens_per_seq -> bucket -> s
        self._weight: dict[int, dict[int, float]] = defaultdict(dict)  # bucket -> tokens_per_seq -> weight

    def observe(self, batch: int, tokens_per_seq: int, seconds: float) -> None:
        row = self._ema[tokens_per_seq]
        b = batch_bucket(batch)
        row[b] = smoothed(row.get(b), seconds, self.smoothing)
        weights = self._weight[b]
        for t in weights:
            weights[t] *= self.weight_decay
        weights[tokens_per_seq] = weights.get(tokens_per_seq, 0.0) + 1.0

    def weight(self, batch: int, tokens_per_seq: int) -> float:
        """The entry's decayed observation count in batch's bucket (0 if never observed there)."""
        return self._weight.get(batch_bucket(batch), {}).get(tokens_per_seq, 0.0)

    def estimate(self, batch: int, tokens_per_seq: int) -> float | None:
        if not self._ema:
            return None
        nearest_t = min(self._ema, key=lambda t: (abs(t - tokens_per_seq), t))
        row = self._ema[nearest_t]
        buckets = sorted(row)
        if batch in row:
            return row[batch]
        i = bisect.bisect_left(buckets, batch)
        if i == 0:
            return row[buckets[0]]
        if i == len(buckets):
            if len(buckets) == 1:
                return row[buckets[-1]] * batch / buckets[-1]
            b0, b1 = buckets[-2], buckets[-1]
        else:
            b0, b1 = buckets[i - 1], buckets[i]
        t0, t1 = row[b0], row[b1]
        return max(t0 + (t1 - t0) * (batch - b0) / (b1 - b0), 1e-9)


class CostObserver(Protocol):
    """Where proposers and the step report what their passes took."""

    def observe_target(self, batch: int, tokens_per_seq: int, seconds: float) -> None: ...
    def observe_draft_first(self, batch: int, seconds: float) -> None: ...
    def observe_draft_step(self, batch: int, seconds: float) -> None: ...
    def observe_catch_up(self, tokens: int, seconds: float) -> None: ...


class MeasuredCosts:
    """Costs for the policy: target forward by (B, T); a round's first draft pass by B (it
    catches up on the tokens the draft has not seen, usually one or two per sequence, and gives
    the first proposal) and each further one-token draft step by B; long (prefill-like) draft
    catch-ups per token; and the engine's per-step overhead outside the model passes (paid once
    per step whatever K is, so it favours longer rounds)."""

    def __init__(self, smoothing: float = 0.1):
        self.target = TimingTable()
        self.draft_first = TimingTable()
        self.draft = TimingTable()
        self.smoothing = smoothing
        self._overhead: float | None = None
        self._catch_up_per_token: float | None = None

    def observe_target(self, batch: int, tokens_per_seq: int, seconds: float) -> None:
        self.target.observe(batch, tokens_per_seq, seconds)

    def observe_draft_first(self, batch: int, seconds: float) -> None:
        self.draft_first.observe(batch, 1, seconds)

    def observe_draft_step(self, batch: int, seconds: float) -> None:
        self.draft.observe(batch, 1, seconds)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        self._catch_up_per_token = smoothed(self._catch_up_per_token, seconds / tokens, self.smoothing)

    def observe_overhead(self, seconds: float) -> None:
        self._overhead = smoothed(self._overhead, max(seconds, 0.0), self.smoothing)

    def step_overhead(self) -> float:
        return self._overhead or 0.0

    def target_time(self, batch: int, tokens_per_seq: int) -> float:
        t = self.target.estimate(batch, tokens_per_seq)
        return t if t is not None else 1.0

    def target_weight(self, batch: int, tokens_per_seq: int) -> float:
        return self.target.weight(batch, tokens_per_seq)

    def draft_time(self, batch: int) -> float:
        t = self.draft.estimate(batch, 1)
        return t if t is not None else 0.0

    def draft_first_time(self, batch: int) -> float:
        t = self.draft_first.estimate(batch, 1)
        return t if t is not None else self.draft_time(batch)

    def catch_up_time(self, tokens: int) -> float:
        """Seconds for the draft to catch up on `tokens` unseen tokens (0 until measured)."""
        return tokens * (self._catch_up_per_token or 0.0)


def calibrate(costs: MeasuredCosts, target: tuple[Llama, CachePool], draft: tuple[Llama, CachePool] | None,
              max_tokens: int, max_batch: int, repeats: int = 3) -> None:
    """Times target passes of 1..max_tokens tokens per sequence and draft passes (a round's
    first, catching up on two tokens, and a one-token step) at power-of-two batch sizes up to
    max_batch. Each shape runs once untimed first (its first call pays one-off costs a policy
    must not mistake for the steady cost); the median of `repeats` is recorded."""
    batch = 1
    while True:
        b = min(batch, max_batch)
        for t in range(1, max_tokens + 1):
            costs.observe_target(b, t, _median_pass(*target, b, t, repeats, all_logits=t > 1))
        if draft is not None:
            costs.observe_draft_first(b, _median_pass(*draft, b, 2, repeats))
            costs.observe_draft_step(b, _median_pass(*draft, b, 1, repeats))
        if b >= max_batch:
            return
        batch *= 2


def _median_pass(model: Llama, pool: CachePool, batch: int, tokens: int, repeats: int, all_logits: bool = False) -> float:
    slots = fill_slots(model, pool, batch, 8)
    try:
        time_pass(model, pool, slots, tokens, 8, all_logits)  # warms up, untimed
        return statistics.median(time_pass(model, pool, slots, tokens, 8, all_logits) for _ in range(repeats))
    finally:
        for s in slots:
            pool.free_slot(s)
