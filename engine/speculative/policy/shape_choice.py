"""Chain or tree, by what each has measured to deliver: tokens per second of decode rounds.

A tree accepts at least what its first chain would, but its drafting, its wider verify pass and
its acceptance on the host cost more; which wins depends on the proposer, the temperature, the
batch and the device. So the adaptive policy keeps, per (greedy or sampled batch, batch-size
bucket), each shape's recent rate: the tokens its rounds gave ÷ their seconds (drafting through
acceptance), both summed with a decay per round. The shape that runs (the incumbent) is taken
while it measures faster; the other is probed now and then: after PROBE_EVERY decisions, then
twice as many while the probes confirm the choice (up to PROBE_MAX), back to PROBE_EVERY when one
overturns it. An unmeasured shape is tried first, trees first.

Text gets easier and harder as it goes, and every round's rate with it, so a probe is judged
against the incumbent's rate of the rounds just before it, not against the probed shape's own
rounds of long ago: a tree probe's tokens are set against the tokens chains were giving in as many
seconds, a chain probe's against the trees'. Once a probe has been taken the faster shape is the
one these sums favour (tree tokens ÷ chain tokens, both decayed per probe: a ratio of sums, so one
lucky round moves it little and neither shape is favoured), not whichever recent rate is higher.
Otherwise a hard stretch of text, lowering the incumbent's recent rate below the other's stale
one, would switch shapes for no gain.
"""

from __future__ import annotations

from engine.speculative.policy.costs import batch_bucket

PROBE_EVERY = 16  # decisions before the first probe of the losing shape
PROBE_MAX = 256  # the longest gap between probes while they keep confirming the choice
DECAY = 0.9  # per round of a shape: the weight its earlier rounds keep in its rate
PROBE_DECAY = 0.8  # per probe: the weight earlier probes keep in the tree ÷ chain estimate


class ShapeChoice:
    def __init__(self):
        self._sums: dict[tuple[bool, int, bool], tuple[float, float]] = {}  # key -> (tokens, seconds), decayed
        # -> decayed (tree tokens, chain tokens) of the probes: each probe's own, and the incumbent's at its recent
        # rate over the probe's seconds
        self._probed: dict[tuple[bool, int], tuple[float, float]] = {}
        self._probing: dict[tuple[bool, int], bool | None] = {}  # the shape (tree?) of the probe just decided
        self._since_probe: dict[tuple[bool, int], int] = {}
        self._gap: dict[tuple[bool, int], int] = {}  # decisions between probes, now
        self._winner: dict[tuple[bool, int], bool] = {}  # the faster shape at the last decision (tree?)

    def take_trees(self, sampled: bool, batch: int) -> bool:
        key = (sampled, batch_bucket(batch))
        self._probing[key] = None
        tree, chain = self.rate(sampled, batch, True), self.rate(sampled, batch, False)
        if tree is None or chain is None:
            return tree is None
        faster = self.trees_faster(sampled, batch)  # both measured here
        if self._winner.get(key, faster) != faster:  # the last probe (or a drift) overturned it
            self._gap[key] = PROBE_EVERY
        self._winner[key] = faster
        n = self._since_probe[key] = self._since_probe.get(key, 0) + 1
        gap = self._gap.get(key, PROBE_EVERY)
        if n < gap:
            return faster
        self._since_probe[key] = 0
        self._gap[key] = min(2 * gap, PROBE_MAX)
        self._probing[key] = not faster
        return not faster

    def observe(self, sampled: bool, batch: int, tree: bool, tokens: int, seconds: float) -> None:
        """A decode round of this shape gave `tokens` (accepted + bonus, all rows) in `seconds`."""
        if seconds <= 0:
            return
        key = (sampled, batch_bucket(batch))
        other = self.rate(sampled, batch, not tree)
        if self._probing.pop(key, None) is tree and other:  # a probe: against the incumbent's now
            trees, chains = (tokens, other * seconds) if tree else (other * seconds, tokens)
            a, b = self._probed.get(key, (0.0, 0.0))
            self._probed[key] = (PROBE_DECAY * a + trees, PROBE_DECAY * b + chains)
        t, s = self._sums.get((*key, tree), (0.0, 0.0))
        self._sums[(*key, tree)] = (DECAY * t + tokens, DECAY * s + seconds)

    def rate(self, sampled: bool, batch: int, tree: bool) -> float | None:
        """Tokens per second of this shape's recent rounds at this batch's bucket; None until measured."""
        sums = self._sums.get((sampled, batch_bucket(batch), tree))
        return sums[0] / sums[1] if sums else None

    def tree_over_chain(self, sampled: bool, batch: int) -> float | None:
        """The probes' estimate of trees' rate ÷ chains' at the same point of the text; None
        before the first probe."""
        probed = self._probed.get((sampled, batch_bucket(batch)))
        return probed[0] / probed[1] if probed and probed[1] > 0 else None

    def trees_faster(self, sampled: bool, batch: int) -> bool:
        """By the probes' ratio once there is one, else by the two recent rates (False while
        either is unmeasured)."""
        ratio = self.tree_over_chain(sampled, batch)
        if ratio is not None:
            return ratio > 1.0
        tree, chain = self.rate(sampled, batch, True), self.rate(sampled, batch, False)
        return tree is not None and chain is not None and tree > chain
