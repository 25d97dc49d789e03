"""A K per request (k_per_request): verify tokens go to the requests whose proposals survive."""

from __future__ import annotations

import pytest

from engine.speculative.policy.costs import MeasuredCosts
from engine.speculative.policy.k_choice import AcceptanceEstimates
from engine.speculative.policy.per_request import (
    PROBE_K,
    BatchView,
    PerRequestPolicy,
    RowPrices,
    StepCost,
    allocate,
    survival,
)


def costs_at(batch: int, plain_ms: float = 10.0, token_ms: float = 1.0, draft_ms: float = 0.5) -> MeasuredCosts:
    """Costs as calibration records them: target passes of 1..9 tokens a row (plain_ms, then
    token_ms per extra token and row), a draft's first pass and its further steps."""
    costs = MeasuredCosts()
    for t in range(1, 10):
        costs.observe_target(batch, t, (plain_ms + token_ms * batch * (t - 1)) * 1e-3)
    for width in (1, 2, 9):
        costs.observe_draft_first(batch, width, draft_ms * 1e-3)
    for n in range(1, 8):
        costs.observe_draft_steps(batch, n, n * draft_ms * 1e-3)
    for k in range(9):
        costs.observe_other(batch, k, 0.1e-3)
    return costs


def view(ids: list[str], rates, caps: list[int], k_max: int, drafts: list[bool] | None = None,
         catch_ups: list[float] | None = None) -> tuple[BatchView, RowPrices]:
    """choose's arguments: the batch (no tried-positions limit) and its prices, a model drafting
    every row unless `drafts` says otherwise."""
    return BatchView(ids, caps, k_max), RowPrices(rates, drafts or [True] * len(ids), "own", catch_ups=catch_ups)


def measured(rounds: dict[str, tuple[int, int]], times: int = 60) -> AcceptanceEstimates:
    """Acceptance estimates after `times` rounds of (accepted, proposed) for each request."""
    estimates = AcceptanceEstimates()
    for _ in range(times):
        for rid, (accepted, proposed) in rounds.items():
            estimates.update(rid, accepted, proposed)
        estimates.end_step()
    return estimates


def choose(rounds: dict[str, tuple[int, int]], batch_costs: MeasuredCosts, k_max: int = 6) -> list[int]:
    ids = list(rounds)
    rates = measured(rounds).rates(ids, k_max)
    policy = PerRequestPolicy(batch_costs)
    return policy.choose(*view(ids, rates, [k_max] * len(ids), k_max)).ks


def test_a_request_that_accepts_gets_k_and_one_that_does_not_gets_none():
    ks = choose({"edit": (6, 6), "code": (0, 6)}, costs_at(2))
    assert ks[0] > 0 and ks[1] == 0


def test_in_a_larger_batch_only_the_accepting_half_speculates():
    rounds = {f"edit{i}": (5, 6) for i in range(4)} | {f"code{i}": (0, 3) for i in range(4)}
    ks = choose(rounds, costs_at(8))
    assert all(k > 0 for k in ks[:4]) and ks[4:] == [0, 0, 0, 0]


def test_uniform_batches_all_speculate_or_all_decode_plainly():
    assert all(k > 0 for k in choose({"a": (6, 6), "b": (6, 6)}, costs_at(2)))
    # verify tokens priced far above what a rejected proposal gives back: plain decoding
    assert choose({"a": (0, 6), "b": (0, 6)}, costs_at(2, token_ms=8.0)) == [0, 0]


def test_a_request_gets_no_more_than_its_cap():
    ids = ["a", "b"]
    rates = measured({"a": (6, 6), "b": (6, 6)}).rates(ids, 6)
    chosen = PerRequestPolicy(costs_at(2)).choose(*view(ids, rates, [2, 6], 6))
    assert chosen.ks[0] <= 2 and chosen.ks[1] > 2


def test_the_allocation_takes_positions_in_survival_order():
    # request 0's third position survives (0.9^3 = 0.73) more often than request 1's first (0.5)
    cost = StepCost(costs_at(2), 2, 4, widths=[1.0] * 5)
    ks, rate, plain = allocate([survival([0.9] * 4, 4), survival([0.5] * 4, 4)], cost, drafts=[False, False])
    assert ks[0] >= 3 and ks[0] >= ks[1]
    assert rate > plain
    assert survival([0.5, 0.5, 0.5], 2) == [0.5, 0.25]


def test_a_request_held_at_zero_is_probed_and_its_wait_doubles():
    ids = ["edit", "code"]
    rates = measured({"edit": (6, 6), "code": (0, 6)}).rates(ids, 6)
    policy = PerRequestPolicy(costs_at(2), probe_every=4)
    choices = [policy.choose(*view(ids, rates, [6, 6], 6)) for _ in range(13)]
    probed = [n for n, c in enumerate(choices) if c.reason == "probe"]
    assert probed == [3, 11]  # after 4 allocations at 0, then after 8
    assert all(choices[n].ks[1] == PROBE_K for n in probed)
    assert all(c.ks[1] == 0 for n, c in enumerate(choices) if n not in probed and c.reason != "plain_probe")


def test_hysteresis_keeps_plain_decoding_until_speculation_wins_by_the_margin():
    ids, costs = ["a", "b"], costs_at(2)
    high = measured({"a": (6, 6), "b": (6, 6)}).rates(ids, 6)
    first = PerRequestPolicy(costs).choose(*view(ids, high, [6, 6], 6))
    gain = first.rate / first.plain_rate - 1.0
    assert any(first.ks) and gain > 0.1
    for margin, speculates in ((gain + 0.05, False), (gain - 0.05, True)):
        policy = PerRequestPolicy(costs, probe_every=1000, hysteresis=margin)
        assert policy.choose(*view(ids, high, [0, 0], 6)).ks == [0, 0]  # no room: plain
        assert any(policy.choose(*view(ids, high, [6, 6], 6)).ks) == speculates


def test_a_verify_pass_is_priced_by_its_tokens_and_its_widest_row_once_ragged_passes_were_measured():
    costs = costs_at(8)
    before = costs.packed_verify_time(8, 16, 1)  # no ragged pass yet: the padded table at 2 tokens a row
    assert before == pytest.approx(costs.verify_times(8, 1)[1])
    for tokens, slots in ((16, 16), (24, 24), (12, 40), (20, 48), (14, 24)):  # padded and ragged passes
        costs.observe_packed(8, tokens, slots, (5.0 + 0.2 * tokens + 0.05 * slots) * 1e-3)
    # 40 tokens, the widest row 6 (48 slots): 5 + 8 + 2.4 ms; the same tokens padded to 9 a row cost more
    assert costs.packed_verify_time(8, 40, 5) == pytest.approx(15.4e-3, rel=1e-6)
    assert costs.packed_verify_time(8, 40, 8) == pytest.approx(16.6e-3, rel=1e-6)
    assert costs.packed_verify_time(8, 8, 0) == pytest.approx(costs.verify_times(8, 1)[0])  # plain: as measured


def test_a_request_the_draft_lags_far_behind_pays_its_catch_up():
    ids = ["caught_up", "behind"]
    rates = measured({"caught_up": (4, 6), "behind": (4, 6)}).rates(ids, 6)
    policy = PerRequestPolicy(costs_at(2), probe_every=1000)
    even = policy.choose(*view(ids, rates, [6, 6], 6)).ks
    assert all(even)
    ks = policy.choose(*view(ids, rates, [6, 6], 6, catch_ups=[0.0, 0.05])).ks
    assert ks[0] > 0 and ks[1] == 0


def test_an_all_plain_batch_probes_one_request_at_a_time():
    ids = [f"r{i}" for i in range(16)]
    rates = measured({rid: (0, 6) for rid in ids}).rates(ids, 6)
    policy = PerRequestPolicy(costs_at(16, token_ms=8.0), probe_every=4)
    choices = [policy.choose(*view(ids, rates, [6] * 16, 6)) for _ in range(13)]
    probed = [n for n, c in enumerate(choices) if c.reason == "probe"]
    assert probed == [3, 11]  # after 4 plain verdicts, then 8
    assert all(sum(k > 0 for k in choices[n].ks) == 1 for n in probed)
    assert all(not any(c.ks) for n, c in enumerate(choices) if n not in probed)


def test_a_request_its_lookup_proposes_for_pays_no_drafting():
    """hybrid: a request whose rounds the n-gram lookup proposes needs no draft pass; the same
    acceptance with the head drafting costs more, so at a drafting cost that outweighs it, only
    the first speculates."""
    ids = ["looked_up", "drafted"]
    rates = measured({"looked_up": (3, 6), "drafted": (3, 6)}).rates(ids, 6)
    costs = costs_at(2, draft_ms=6.0)
    ks = PerRequestPolicy(costs).choose(*view(ids, rates, [6, 6], 6, drafts=[False, True])).ks
    assert ks[0] > 0 and ks[1] == 0


def test_the_caps_are_clipped_in_the_view_for_reuse_and_choose_alike():
    """BatchView.allowed: at k_max, and one position past those judged (at least PROBE_K); a
    request never judged proposes PROBE_K at most, one judged 4 deep up to 5."""
    assert BatchView(["a", "b"], [9, 3], 6).allowed() == [6, 3]
    assert BatchView(["a", "b", "c"], [9, 9, 1], 6, tried=[0, 4, 4]).allowed() == [PROBE_K, 5, 1]
    ids = ["a", "b"]
    rates = measured({"a": (6, 6), "b": (6, 6)}).rates(ids, 6)
    batch = BatchView(ids, [6, 6], 6, tried=[0, 3], version=1)
    chosen = PerRequestPolicy(costs_at(2)).choose(batch, RowPrices(rates, [True, True]))
    assert chosen.ks[0] <= PROBE_K and chosen.ks[1] <= 4 and any(chosen.ks)
    policy = PerRequestPolicy(costs_at(2, token_ms=8.0), probe_every=1000)
    low = measured({"a": (0, 6), "b": (0, 6)}).rates(ids, 6)
    assert policy.choose(batch, RowPrices(low, [True, True])).ks == [0, 0]
    assert policy.reuse(batch) is not None  # the same batch, room and estimates: the verdict holds
    assert policy.reuse(BatchView(ids, [6, 6], 6, tried=[3, 3], version=1)) is None  # more room: afresh
