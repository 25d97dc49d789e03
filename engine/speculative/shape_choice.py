"""Chain or tree, by what each has measured to deliver: tokens per second of decode rounds.

A tree accepts at least what its first chain would, but its drafting, its wider verify pass and
its acceptance on the host cost more; which wins depends on the proposer, the temperature, the
batch and the device. So the adaptive policy keeps, per (greedy or sampled batch, batch-size
bucket), each shape's rate: the tokens its rounds gave ÷ their seconds (drafting through
acceptance), both summed with a decay per round (a ratio of sums: one round's luck moves it
little), and takes the faster.
The other shape is still taken now and then, so a change (a workload, a batch mix) is seen: after
PROBE_EVERY decisions, then twice as many while the probes confirm the choice (up to PROBE_MAX),
back to PROBE_EVERY when one overturns it. An unmeasured shape is tried first, trees first.
"""

from __future__ import annotations

from engine.speculative.costs import batch_bucket

PROBE_EVERY = 16  # decisions before the first probe of the losing shape
PROBE_MAX = 256  # the longest gap between probes while they keep confirming the choice
DECAY = 0.9  # per round of a shape: the weight its earlier rounds keep in its rate


class ShapeChoice:
    def __init__(self):
        self._sums: dict[tuple[bool, int, bool], tuple[float, float]] = {}  # key -> (tokens, seconds), decayed
        self._since_probe: dict[tuple[bool, int], int] = {}
        self._gap: dict[tuple[bool, int], int] = {}  # decisions between probes, now
        self._winner: dict[tuple[bool, int], bool] = {}  # the faster shape at the last decision (tree?)

    def take_trees(self, sampled: bool, batch: int) -> bool:
        key = (sampled, batch_bucket(batch))
        tree, chain = self.rate(sampled, batch, True), self.rate(sampled, batch, False)
        if tree is None or chain is None:
            return tree is None
        faster = tree > chain
        if self._winner.get(key, faster) != faster:  # the last probe (or a drift) overturned it
            self._gap[key] = PROBE_EVERY
        self._winner[key] = faster
        n = self._since_probe[key] = self._since_probe.get(key, 0) + 1
        gap = self._gap.get(key, PROBE_EVERY)
        if n < gap:
            return faster
        self._since_probe[key] = 0
        self._gap[key] = min(2 * gap, PROBE_MAX)
        return not faster

    def observe(self, sampled: bool, batch: int, tree: bool, tokens: int, seconds: float) -> None:
        """A decode round of this shape gave `tokens` (accepted + bonus, all rows) in `seconds`."""
        if seconds <= 0:
            return
        key = (sampled, batch_bucket(batch), tree)
        t, s = self._sums.get(key, (0.0, 0.0))
        self._sums[key] = (DECAY * t + tokens, DECAY * s + seconds)

    def rate(self, sampled: bool, batch: int, tree: bool) -> float | None:
        """Tokens per second of this shape's rounds at this batch's bucket; None until measured."""
        sums = self._sums.get((sampled, batch_bucket(batch), tree))
        return sums[0] / sums[1] if sums else None
