"""The policy's prices corrected by what its steps realized: per (batch bucket, K chosen) and
component (each phase's seconds, and the tokens a step gains over plain decoding), the ratio
realized ÷ predicted of recent steps (exponentially weighted), shrunk towards 1 by PRIOR_STEPS
steps' worth of trust in the prices as they are. The self-check's predictions are the prices
before correction, so the ratios measure the prices' own error and the correction does not feed
on itself."""

from __future__ import annotations

from engine.speculative.policy.costs import batch_bucket

COMPONENTS = ("draft", "verify", "other", "gain")
PRIOR_STEPS = 50.0  # steps' worth of trust in an uncorrected price
DECAY = 0.99  # a step's weight falls by this every later step at the same key
LIMITS = (0.5, 2.0)  # a correction never scales a price beyond these


class Corrections:
    def __init__(self):
        self._sums: dict[tuple[int, int], dict[str, list[float]]] = {}  # key -> component -> [predicted, realized, steps]

    def observe(self, batch: int, k: int, predicted: dict[str, float], realized: dict[str, float]) -> None:
        """One step's figures by component (COMPONENTS; a component predicted at 0 is skipped)."""
        sums = self._sums.setdefault((batch_bucket(batch), k), {c: [0.0, 0.0, 0.0] for c in COMPONENTS})
        for component, (p, r, n) in sums.items():
            sums[component] = [p * DECAY, r * DECAY, n * DECAY]
            if predicted.get(component, 0.0) > 0:
                sums[component] = [p * DECAY + predicted[component], r * DECAY + realized[component], n * DECAY + 1]

    def factor(self, batch: int, k: int, component: str) -> float:
        """realized ÷ predicted at (batch's bucket, k), shrunk towards 1; 1 where nothing was observed."""
        sums = self._sums.get((batch_bucket(batch), k))
        if sums is None:
            return 1.0
        predicted, realized, steps = sums[component]
        if predicted <= 0:
            return 1.0
        shrunk = (steps * realized / predicted + PRIOR_STEPS) / (steps + PRIOR_STEPS)
        return min(max(shrunk, LIMITS[0]), LIMITS[1])
