"""Exploration under a budget. The adaptive policies explore: a "probe" speculates after a run of
plain verdicts, a "plain_probe" decodes one step plainly in a run of speculative ones, a "k_probe"
takes a K near the verdict's (k_choice.SpecPolicy, per_request.PerRequestPolicy). Left to their
schedules, those steps take up to 12.5% of a speculative stretch (a K probe every 8th choice) and
up to 3% of a plain one (a probe after 32 plain verdicts, before its backoff): `ExplorationBudget`
holds them to SHARE of the adaptive decode steps, and a step it declines runs the verdict instead.

A probe's rows (`probe_rows`): every row that can propose without a long catch-up (a lookup's
rows; a model's rows it lags at most long_catch_up behind), else the one it lags least behind.
Where that is every row, the probe's verify pass is the (B, K + 1) pass the plans price, and it is
recorded as one (the padded table, and the step's time outside its passes at (B, K)); where rows sit
out, the pass packs and feeds the tokens-and-slots fit (fits.PassCostFit) only.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.speculative.policy.k_choice import Choice

SHARE = 0.02  # the most of the adaptive decode steps that may explore
EXPLORING = frozenset({"probe", "plain_probe", "k_probe"})  # the reasons of a step that explores


class ExplorationBudget:
    """A step may explore while it holds a credit: every decode step under the adaptive policy
    earns `share` of one (at most one held), an exploring step spends one. Over n steps at most
    share x n + 1 explore, whatever the policies' schedules ask."""

    def __init__(self, share: float = SHARE):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {share}")
        self.share = share
        self.credit = 1.0
        self.steps = self.explored = self.declined = 0

    def allow(self, exploring: bool) -> bool:
        """Counts one adaptive decode step; whether it may explore (True for one that does not ask)."""
        self.steps += 1
        self.credit = min(1.0, self.credit + self.share)
        if not exploring:
            return True
        if self.credit >= 1.0 - 1e-9:  # (sums of `share` fall short of 1 by rounding)
            self.credit -= 1.0
            self.explored += 1
            return True
        self.declined += 1
        return False

    def summary(self) -> dict:
        """Steps counted, those that explored and those declined, and the share explored."""
        return {"steps": self.steps, "explored": self.explored, "declined": self.declined,
                "share": self.explored / self.steps if self.steps else 0.0, "budget": self.share}


def probe_rows(ks: Sequence[int], lags: Sequence[int], models: Sequence[bool], long_catch_up: int) -> list[int]:
    """A probe's K for each row (ks: what each may propose): kept for the rows that propose
    without a long catch-up (models[i] False: a lookup's row; or lags[i] <= long_catch_up), 0 for
    the others; where no row may, kept for the one the proposer lags least behind only (catching
    the whole batch up after a plain stretch would cost about a prefill)."""
    candidates = [i for i, k in enumerate(ks) if k > 0]
    ready = {i for i in candidates if not models[i] or lags[i] <= long_catch_up}
    if not ready and candidates:
        ready = {min(candidates, key=lambda i: lags[i])}
    return [k if i in ready else 0 for i, k in enumerate(ks)]


def verdict_k(goodput: dict[int, float], last_k: int, k_max: int) -> int:
    """The K a declined plain or K probe runs instead: the best-scored K > 0 (the verdict it
    replaced speculated), else the last speculative K, within 1..k_max."""
    scored = [k for k in goodput if 0 < k <= k_max]
    if scored:
        return max(scored, key=goodput.get)
    return max(1, min(last_k, k_max))


def declined(choice: Choice, last_k: int, k_max: int) -> Choice:
    """What a one-K step the budget declines runs: after a probe, the plain verdict it broke; after
    a plain or K probe, the speculative verdict (verdict_k)."""
    if choice.reason == "probe":
        return Choice(0, "policy", choice.goodput)
    return Choice(verdict_k(choice.goodput, last_k, k_max), "policy", choice.goodput)
