"""K = 0 does what plain does: an all-plain adaptive step runs no draft (it never proposes), no
planning while the last all-plain verdict can be reused (`PlainVerdicts`; the per-request
policy's own `reuse` likewise) and no feature capture for rows that cannot draft
(`PlainStretch`).

Which rows stop capturing: every row of a plain step under a verdict that keeps the batch plain
whatever the estimates say (QUIET: a batch at spec_disable_batch_size, every request at its length
guard). The adaptive policy's own plain verdict keeps capturing: coming back from a lapse, the
head drafts from a short context and accepts little, which kept a batch-1 server plain (its
estimates fell with every restart). A plain probe, a step whose proposer proposed nothing, a cold
start's unmeasured steps and prefill passes keep capturing too. What coming back costs: a row whose features lapsed cannot draft
from them, so a plan that drafts for it is put off one step, which decodes plainly with capture on
(reason no_proposal); the head then restarts from that position (its earlier context is dropped,
eagle.py's new run), so its first rounds draft from a short context.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import DecodeResult, Request
from engine.speculative.policy.per_request import REUSE_PLAIN

QUIET = frozenset({"disabled_batch_size", "length_guard"})  # plain verdicts that capture nothing


class PlainVerdicts:
    """The one-K policy's all-plain verdict, reused for up to REUSE_PLAIN steps while nothing it
    was judged on changed (the batch and the requests joining it, their caps clipped at
    spec_length, the acceptance estimates' version) but the costs, a little."""

    def __init__(self):
        self._key: tuple | None = None
        self._reused = 0

    @staticmethod
    def key(reqs: Sequence[Request], caps: Sequence[int], running: Sequence[Request], version: object,
            spec_length: int) -> tuple:
        return (tuple(r.request_id for r in reqs), tuple(min(c, spec_length) for c in caps),
                tuple(r.request_id for r in running), version)

    def reuse(self, key: tuple, policy) -> bool:
        """Whether the last verdict, all plain, holds for this step: counted as the plain choice
        it stands for in the policy's probe schedule (SpecPolicy.count_reused_plain), so a plain
        stretch probes as often in steps as without reuse; where that choice would be a probe,
        the policy chooses."""
        if key != self._key or self._reused >= REUSE_PLAIN or not policy.count_reused_plain():
            return False
        self._reused += 1
        return True

    def keep(self, key: tuple, plain: bool) -> None:
        """A verdict judged afresh: kept when all plain, else forgotten."""
        self._key, self._reused = (key if plain else None), 0


class PlainStretch:
    """The plain pass of a step, capture off under a QUIET verdict; the requests whose features
    lapsed that way, and a plan put off until their features are back."""

    def __init__(self):
        self.lapsed: set[str] = set()
        self._deferred: tuple[tuple[str, ...], object] | None = None

    def decode(self, runner, reqs: list[Request], reason: str) -> DecodeResult:
        layers = runner.capture
        if reason not in QUIET or not layers:
            self.captured(reqs)
            return runner.decode(reqs, reason)
        runner.capture = ()
        try:
            result = runner.decode(reqs, reason)
        finally:
            runner.capture = layers
        self.lapsed.update(r.request_id for r in reqs)
        return result

    def captured(self, reqs: Sequence[Request]) -> None:
        """A pass with capture on: the requests' features run again from it."""
        if self.lapsed:
            self.lapsed.difference_update(r.request_id for r in reqs)

    def needs_features(self, reqs: Sequence[Request], ks: Sequence[int], models: Sequence[bool]) -> bool:
        """Whether a model would draft (ks[i] > 0, models[i]) for a request whose features lapsed."""
        return bool(self.lapsed) and any(k and m and r.request_id in self.lapsed for r, k, m in zip(reqs, ks, models))

    def defer(self, reqs: Sequence[Request], plan: object) -> None:
        self._deferred = (tuple(r.request_id for r in reqs), plan)

    def deferred(self, reqs: Sequence[Request]) -> object | None:
        """The plan put off last step, where the batch is the same (else None); forgotten either way."""
        held, self._deferred = self._deferred, None
        if held is None or held[0] != tuple(r.request_id for r in reqs):
            return None
        return held[1]

    def forget(self, request_id: str) -> None:
        self.lapsed.discard(request_id)
