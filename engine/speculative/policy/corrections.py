"""The policy's prices corrected by what its steps realized: per (batch bucket, K chosen) and
component (each phase's seconds, and the tokens a step gains over plain decoding), the ratio
realized ÷ predicted of recent steps (exponentially weighted). A speculative K's ratio is shrunk
towards its bucket's ratio over every K > 0 (by K_STEPS steps' worth), and that towards 1 (by
PRIOR_STEPS): prices that are off at K = 1 (stale calibration, a proposer's bookkeeping the passes
leave out) are off at K = 2 as well, so a K not yet run at a bucket starts from what the others
found instead of from its uncorrected price. Plain (K = 0) is corrected by its own steps only.
The self-check's predictions are the prices before correction, so the ratios measure the prices'
own error and the correction does not feed on itself."""

from __future__ import annotations

from engine.speculative.policy.costs import batch_bucket

COMPONENTS = ("draft", "verify", "other", "gain")
PRIOR_STEPS = 20.0  # steps' worth of trust in an uncorrected price
K_STEPS = 8.0  # steps' worth of trust in the bucket's ratio over every K > 0, against one K's own
DECAY = 0.99  # a step's weight falls by this every later step at the same key
LIMITS = (0.5, 2.0)  # a correction never scales a price beyond these
SPECULATIVE = -1  # the key's K for a bucket's steps at every K > 0 together

Sums = dict[str, list[float]]  # component -> [predicted, realized, steps], decayed


class Corrections:
    def __init__(self):
        self._sums: dict[tuple[int, int], Sums] = {}  # (bucket, K or SPECULATIVE) -> sums

    def observe(self, batch: int, k: int, predicted: dict[str, float], realized: dict[str, float]) -> None:
        """One step's figures by component (COMPONENTS; a component predicted at 0 is skipped)."""
        keys = [k] if k == 0 else [k, SPECULATIVE]
        for key in keys:
            sums = self._sums.setdefault((batch_bucket(batch), key), {c: [0.0, 0.0, 0.0] for c in COMPONENTS})
            for component, (p, r, n) in sums.items():
                sums[component] = [p * DECAY, r * DECAY, n * DECAY]
                if predicted.get(component, 0.0) > 0:
                    sums[component] = [p * DECAY + predicted[component], r * DECAY + realized[component],
                                       n * DECAY + 1]

    def factor(self, batch: int, k: int, component: str) -> float:
        """realized ÷ predicted at (batch's bucket, k), shrunk as the module says; 1 where nothing
        was observed."""
        return self.factors(batch, k)[component][k]

    def factors(self, batch: int, k_max: int) -> dict[str, list[float]]:
        """factor(batch, k, component) for K = 0..k_max, per component (COMPONENTS), in one pass."""
        bucket = batch_bucket(batch)
        pooled_sums, out = self._sums.get((bucket, SPECULATIVE)), {}
        for component in COMPONENTS:
            pooled = _shrunk(pooled_sums, component, 1.0, PRIOR_STEPS)
            row = [_shrunk(self._sums.get((bucket, 0)), component, 1.0, PRIOR_STEPS)]
            row += [_shrunk(self._sums.get((bucket, k)), component, pooled, K_STEPS) for k in range(1, k_max + 1)]
            out[component] = [min(max(f, LIMITS[0]), LIMITS[1]) for f in row]
        return out


def _shrunk(sums: Sums | None, component: str, towards: float, weight: float) -> float:
    """(steps x realized ÷ predicted + weight x towards) ÷ (steps + weight); `towards` unobserved."""
    if sums is None:
        return towards
    predicted, realized, steps = sums[component]
    if predicted <= 0:
        return towards
    return (steps * realized / predicted + weight * towards) / (steps + weight)
