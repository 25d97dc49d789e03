"""Measured forward-pass times, for the adaptive policy: exponential moving averages per
(batch size, tokens per sequence), interpolated between the sizes measured; measure.py fills
them for one batch size (at start-up: batch 1, and the largest batch when it is first needed). A
round's further one-token draft steps are timed together,
by how many (the call that runs them has a fixed cost of its own). A decode step's time outside
its passes (sampling, acceptance, bookkeeping: it grows with B x (K + 1) logits; and the
proposer's own work beyond the draft passes it times) is measured per (batch size, K) too. The
tables snapshot to JSON and restore from it (a start-up's cached calibration, calibration.py).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

from engine.speculative.policy.fits import (
    LINE_TRUST,
    LineEstimate,
    PassCostFit,
    interpolated,
    least_squares,
    smoothed,
    trusted_line,
)


def batch_bucket(batch: int) -> int:
    return 1 << max(0, (batch - 1).bit_length())


class TimingTable:
    """Entries are kept per exact batch size: a batch draining as its requests finish runs passes
    over fewer rows, and those must not price the full batch (a verify pass over 20 rows is far
    cheaper than over 32, and plain decoding, which drains all at once, has no such passes).

    weight(batch, T): how much an entry is to be trusted against the other T of its batch
    bucket (next power of two): every observation in the bucket decays the bucket's weights by
    `weight_decay` and adds 1 to the observed T's, so entries measured recently and often
    outweigh those last measured long ago (at start-up calibration, over a short context). An
    entry of little weight takes a new observation at 1 / (1 + weight), between `smoothing` and
    STALE_STEP: one observation after a long gap replaces half a stale figure, not a fifth of it
    (nor all of it: a single step can be off by more than the policy's margins)."""

    STALE_STEP = 0.5

    def __init__(self, smoothing: float = 0.2, weight_decay: float = 0.98):
        self.smoothing = smoothing
        self.weight_decay = weight_decay
        self._ema: dict[int, dict[int, float]] = defaultdict(dict)  # tokens_per_seq -> batch -> s
        self._weight: dict[int, dict[int, float]] = defaultdict(dict)  # bucket -> tokens_per_seq -> weight
        self.version = 0  # changes with every observation and restore

    def observe(self, batch: int, tokens_per_seq: int, seconds: float) -> None:
        self.version += 1
        row = self._ema[tokens_per_seq]
        weights = self._weight[batch_bucket(batch)]
        step = min(self.STALE_STEP, 1.0 / (1.0 + weights.get(tokens_per_seq, 0.0)))
        row[batch] = smoothed(row.get(batch), seconds, max(self.smoothing, step))
        for t in weights:
            weights[t] *= self.weight_decay
        weights[tokens_per_seq] = weights.get(tokens_per_seq, 0.0) + 1.0

    def snapshot(self) -> dict:
        """The table as JSON-ready data (restore() reads it back)."""
        return {"ema": {t: {b: s for b, s in row.items()} for t, row in self._ema.items()},
                "weight": {b: dict(w) for b, w in self._weight.items()}}

    def restore(self, data: dict) -> None:
        """Replaces the table with a snapshot's (keys may arrive as strings, as JSON writes them);
        ValueError for a time or weight that is not a finite number >= 0."""
        self.version += 1
        self._ema = defaultdict(dict, {int(t): {int(b): _non_negative(s) for b, s in row.items()}
                                       for t, row in data["ema"].items()})
        self._weight = defaultdict(dict, {int(b): {int(t): _non_negative(w) for t, w in row.items()}
                                          for b, row in data["weight"].items()})

    def batches(self, tokens_per_seq: int) -> list[int]:
        """The batch sizes observed at tokens_per_seq."""
        return sorted(self._ema.get(tokens_per_seq, {}))

    def weight(self, batch: int, tokens_per_seq: int) -> float:
        """The entry's decayed observation count in batch's bucket (0 if never observed there)."""
        return self._weight.get(batch_bucket(batch), {}).get(tokens_per_seq, 0.0)

    def fitted(self, batch: int, ts: range, least_weight: float, default: float) -> list[float]:
        """Estimates for each T in `ts` (consecutive): trusted_line over their entries."""
        times = [self.estimate(batch, t) or default for t in ts]
        return trusted_line(times, [self.weight(batch, t) for t in ts], least_weight)

    def observed(self, tokens_per_seq: int) -> bool:
        """Whether any batch size was observed at tokens_per_seq."""
        return tokens_per_seq in self._ema

    def nearest(self, tokens_per_seq: int) -> int | None:
        """The observed T nearest tokens_per_seq (the smaller on a tie); None before any observation."""
        return min(self._ema, key=lambda t: (abs(t - tokens_per_seq), t)) if self._ema else None

    def estimate(self, batch: int, tokens_per_seq: int) -> float | None:
        if not self._ema:
            return None
        row = self._ema.get(tokens_per_seq)  # the policy asks for measured T nearly always
        if row is None:
            row = self._ema[self.nearest(tokens_per_seq)]
        if batch in row:
            return row[batch]
        sizes = sorted(row)
        i = bisect.bisect_left(sizes, batch)
        if i == 0:
            return row[sizes[0]]
        if i == len(sizes):
            if len(sizes) == 1:
                return row[sizes[-1]] * batch / sizes[-1]
            b0, b1 = sizes[-2], sizes[-1]
        else:
            b0, b1 = sizes[i - 1], sizes[i]
        t0, t1 = row[b0], row[b1]
        return max(t0 + (t1 - t0) * (batch - b0) / (b1 - b0), 1e-9)


def _non_negative(value) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"a measured time or weight must be a finite number >= 0, got {value!r}")
    return value


REFIT_EVERY = 16  # the engine's refit_every: about four decode steps' observations (target, other, drafting)


class MeasuredCosts:
    """Costs for the policy: target forward by (B, T); a round's first draft pass by (B, width)
    (it catches up on the tokens the proposer has not seen, `width` for the longest row, and
    gives the first proposal) and its further one-token draft steps by (B, how many); long
    (prefill-like) draft catch-ups per token; and a step's time outside the passes by (B, K)
    (paid once per step, so it favours longer rounds)."""

    STALE_WEIGHT = 0.05  # least weight of a time in a line fit (calibrated, never measured since)

    def __init__(self, smoothing: float = 0.1, refit_every: int = 1):
        """refit_every: observations (of any table) a fit may lag behind (_read); 1: none."""
        if refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every}")
        self.refit_every = refit_every
        self.target = TimingTable()
        self.draft_first = TimingTable()
        self.draft = TimingTable()  # (B, steps) -> seconds of a round's `steps` further one-token steps
        self.smoothing = smoothing
        self.other = TimingTable()  # (B, K) -> a decode step's seconds outside its passes
        self.catch_up = LineEstimate(smoothing)  # tokens -> seconds of a long draft catch-up
        self.packed: dict[int, PassCostFit] = {}  # batch bucket -> verify passes by tokens and slots
        self.draft_pass_seconds = 0.0  # all draft passes observed so far (what a proposer spent beyond them is "other")
        self._memo: dict = {}  # (reader, args) -> (the tables, their versions' sum, the fit) (_read)

    TABLES = ("target", "draft_first", "draft", "other")

    def _read(self, name: str, fn, *args):
        """fn(*args), kept until the tables have taken refit_every observations since (or one was
        replaced): a step's plan and its self-check read the same fits, and the engine refits
        every few steps (a fit over every (B, K) entry costs 20-70 us, a choice at K up to 8 reads
        three; one observation moves a fit over dozens of entries little)."""
        tables = tuple(getattr(self, n) for n in self.TABLES)
        versions = sum(t.version for t in tables)
        key = (name, *args)
        kept = self._memo.get(key)
        if kept is not None and all(a is b for a, b in zip(kept[0], tables)) and versions - kept[1] < self.refit_every:
            return kept[2]
        value = fn(*args)
        self._memo[key] = (tables, versions, value)
        return value

    def snapshot(self) -> dict:
        """Every table and line as JSON-ready data: what a start-up reads back instead of measuring."""
        return {**{name: getattr(self, name).snapshot() for name in self.TABLES}, "catch_up": self.catch_up.snapshot()}

    def restore(self, data: dict) -> None:
        """The tables of a snapshot (KeyError / ValueError / TypeError when it is not one)."""
        tables = {name: TimingTable(getattr(self, name).smoothing, getattr(self, name).weight_decay)
                  for name in self.TABLES}
        for name, table in tables.items():
            table.restore(data[name])
        catch_up = LineEstimate(self.smoothing)
        catch_up.restore(data["catch_up"])
        for name, table in tables.items():  # all or nothing: a bad snapshot leaves the costs as they were
            setattr(self, name, table)
        self.catch_up = catch_up

    def observe_target(self, batch: int, tokens_per_seq: int, seconds: float) -> None:
        self.target.observe(batch, tokens_per_seq, seconds)

    def observe_packed(self, batch: int, tokens: int, slots: int, seconds: float) -> None:
        """A verify pass over `batch` rows whose linears computed `tokens` tokens (the rows' total
        when packed) in a padded layout of `slots` (rows x the widest row)."""
        self.packed.setdefault(batch_bucket(batch), PassCostFit(self.smoothing)).observe(tokens, slots, seconds)

    def packed_verify_time(self, batch: int, total_tokens: int, depth: int) -> float:
        """Seconds of a target pass over `batch` rows, `total_tokens` tokens, the widest row
        depth + 1 tokens (PackedVerify)."""
        return PackedVerify(self, batch, max(1, depth))(total_tokens, depth)

    def observe_draft_first(self, batch: int, width: int, seconds: float) -> None:
        self.draft_first.observe(batch, width, seconds)
        self.draft_pass_seconds += seconds

    def observe_draft_steps(self, batch: int, steps: int, seconds: float) -> None:
        """`steps` one-token draft steps over `batch` rows took `seconds` in all."""
        self.draft.observe(batch, steps, seconds)
        self.draft_pass_seconds += seconds

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        self.catch_up.observe(tokens, seconds)
        self.draft_pass_seconds += seconds

    def observe_other(self, batch: int, k: int, seconds: float) -> None:
        self.other.observe(batch, k, max(seconds, 0.0))

    def verify_times(self, batch: int, k_max: int) -> list[float]:
        """Target pass seconds for K = 0..k_max (K + 1 tokens per sequence): plain (one token, the
        last position's logits only) as measured, K >= 1 fitted through all (trusted_line; the
        cost per token falls a little with T, so the line prices T = 1 above its own figure)."""
        return list(self._read("verify", self._verify_times, batch, k_max))

    def _verify_times(self, batch: int, k_max: int) -> list[float]:
        line = self.target.fitted(batch, range(1, k_max + 2), self.STALE_WEIGHT, 1.0)
        plain = self.target.estimate(batch, 1)
        return [line[0] if plain is None else plain] + line[1:]

    def other_times(self, batch: int, k_max: int) -> list[float]:
        """A step's seconds outside its passes for K = 0..k_max (other_fit: plain on its own fit,
        K >= 1 on theirs); 0 until measured."""
        return list(self._read("other", self._other_times, batch, k_max))

    def _other_times(self, batch: int, k_max: int) -> list[float]:
        if not self.other.batches(0) and not any(self.other.observed(k) for k in range(1, k_max + 1)):
            return [0.0] * (k_max + 1)
        return other_fit(self.other, batch, range(0, 1), self.STALE_WEIGHT) + other_fit(
            self.other, batch, range(1, k_max + 1), self.STALE_WEIGHT)

    def draft_times(self, rows: int, k_max: int) -> tuple[list[float], list[float]]:
        """Over `rows` sequences (k_max >= 1): a round's first draft pass at widths 1..k_max + 1,
        and its 0..k_max - 1 further one-token steps, each on trusted_line (a fixed part and a part
        per width or step). A step count never observed enters the line at least weight as that
        many steps at the per-step time of the count observed nearest 1 (calibration observes
        them all; an engine switched to the adaptive policy later has seen only its fixed K's).
        0 until measured."""
        first, further = self._read("draft", self._draft_times, rows, k_max)
        return list(first), list(further)

    def _draft_times(self, rows: int, k_max: int) -> tuple[list[float], list[float]]:
        nearest = self.draft.nearest(1)
        one = (self.draft.estimate(rows, nearest) or 0.0) / nearest if nearest else 0.0
        first = self.draft_first.fitted(rows, range(1, k_max + 2), self.STALE_WEIGHT, one)
        counts = range(1, k_max)  # empty for k_max <= 1: no further steps
        times = [self.draft.estimate(rows, n) if self.draft.observed(n) else n * one for n in counts]
        return first, [0.0] + trusted_line(times, [self.draft.weight(rows, n) for n in counts], self.STALE_WEIGHT)

    def catch_up_time(self, tokens: int) -> float:
        """Seconds for the draft to catch up on `tokens` unseen tokens (0 until measured)."""
        return self.catch_up(tokens)


class PackedVerify:
    """Seconds of a target pass over `batch` rows by its total tokens and its widest row: plain
    (one token a row) as measured; a ragged verify pass on the fit of such passes at the batch's
    bucket (PassCostFit) once there is one, else as the padded pass of the same tokens (total /
    batch a row, interpolated in the padded table). Fixed for a step: the policy prices many
    allocations with it."""

    def __init__(self, costs: MeasuredCosts, batch: int, k_max: int):
        self.batch = batch
        self.padded = costs.verify_times(batch, k_max)  # [k_max + 1]
        fit = costs.packed.get(batch_bucket(batch))
        self.fit = fit.coefficients() if fit is not None else None

    def __call__(self, total_tokens: float, depth: int) -> float:
        if total_tokens > self.batch and self.fit is not None:
            a, b, c = self.fit
            return max(self.padded[0], a + b * total_tokens + c * self.batch * (depth + 1))
        return interpolated(self.padded, min(total_tokens / self.batch - 1.0, len(self.padded) - 1))


def other_fit(table: TimingTable, batch: int, ks: range, least_weight: float) -> list[float]:
    """A step's time outside its passes at `batch` for each K in `ks`, from every (B, K in ks)
    entry of `table`: seconds = a + b B + c B K by weighted least squares (each entry weighted by
    its trust, at least least_weight; a + b B (K + 1) while B or K has not varied enough, the
    table's own estimate while neither fits), and an entry observed at this exact batch shrunk
    towards it as in trusted_line. So a batch size never seen is priced by the whole table, never
    extrapolated from its two nearest sizes."""
    entries = [(b, k, table.estimate(b, k), max(table.weight(b, k), least_weight))
               for k in ks if table.observed(k) for b in table.batches(k)]
    fit = None
    for features in ((lambda b, k: (1.0, b, b * k)), (lambda b, k: (1.0, b * (k + 1)))):
        fit = least_squares([features(b, k) for b, k, _, _ in entries], [y for *_, y, _ in entries],
                             [w for *_, w in entries])
        if fit is not None:
            break
    out = []
    for k in ks:
        line = (sum(c * x for c, x in zip(fit, features(batch, k))) if fit is not None
                else table.estimate(batch, k) or 0.0)
        line = max(line, 0.0)
        if table.observed(k) and batch in table.batches(k):
            w = table.weight(batch, k)
            line = (w * table.estimate(batch, k) + LINE_TRUST * line) / (w + LINE_TRUST)
        out.append(line)
    return out
