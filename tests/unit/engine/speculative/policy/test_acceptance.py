"""Acceptance estimates by proposer and by greedy or sampled rows (AcceptanceKey), and a pool that
ages in plain stretches too."""

from __future__ import annotations

import pytest

from engine.speculative.policy.k_choice import AcceptanceEstimates


def rounds(estimates: AcceptanceEstimates, per_key: dict, steps: int = 40) -> AcceptanceEstimates:
    """`steps` steps, each with one round (accepted, proposed) for each key, from 4 requests a key."""
    for step in range(steps):
        for n, (key, (accepted, proposed)) in enumerate(per_key.items()):
            estimates.update(f"{n}-{step % 4}", accepted, proposed, key)
        estimates.end_step()
    return estimates


def test_greedy_and_sampled_rows_are_kept_apart():
    estimates = rounds(AcceptanceEstimates(), {("eagle", False): (3, 4), ("eagle", True): (0, 4)})
    greedy, sampled = estimates.rates(["a", "b"], 4, [("eagle", False), ("eagle", True)])
    assert greedy[0] > 0.9 and greedy[3] < 0.3  # three of four accepted: the fourth position fails
    assert sampled[0] < 0.1
    mixed = estimates.rates(["c"], 4)[0]
    assert sampled[0] < mixed[0] < greedy[0]


def test_a_key_never_seen_borrows_all_rounds_and_a_request_keeps_its_proposers_apart():
    estimates = rounds(AcceptanceEstimates(), {("ngram", False): (4, 4), ("draft", False): (0, 4)})
    all_rounds = estimates.rates(["new"], 4)[0]
    assert estimates.rates(["new"], 4, [("suffix", True)])[0] == pytest.approx(all_rounds)
    for _ in range(30):  # one request: its lookup rounds accepted, its model rounds not
        estimates.update("r", 4, 4, ("ngram", False))
        estimates.update("r", 0, 4, ("draft", False))
    by_lookup, by_model = estimates.rates(["r", "r"], 4, [("ngram", False), ("draft", False)])
    assert by_lookup[0] > 0.95 and by_model[0] < 0.05
    assert estimates.tried(["r"], 31) == [1]  # positions judged over both proposers (60 rounds at 1)


def test_plain_steps_age_the_pools_without_changing_the_version():
    """A plain stretch's evidence fades as a speculative one's does; the ageing waits until the
    estimates are next read, so `version` stays and a plain verdict can be reused meanwhile."""
    key = ("eagle", False)
    plain = rounds(AcceptanceEstimates(), {key: (0, 4)})
    spec = rounds(AcceptanceEstimates(), {key: (0, 4)})
    before = plain.rates(["new"], 4, [key])[0]
    version = plain.version
    for _ in range(200):
        plain.end_step(plain=True)
        spec.end_step()
    assert plain.version == version
    after = plain.rates(["new"], 4, [key])[0]
    assert after == pytest.approx(spec.rates(["new"], 4, [key])[0])  # the same ageing, read lazily
    assert before[0] < 0.05 < 0.3 < after[0] < AcceptanceEstimates.PRIOR_RATE  # back towards the prior


def test_a_chain_that_stopped_short_of_the_k_asked_counts_its_next_position_as_rejected():
    """Asked for 4, a lookup offered 2 and both were accepted: 3 tokens came, not the 5 that
    asking for 4 at these rates promises, so position 3 counts as judged and rejected; a tree as
    deep as its shape (chains=False) and a row offered all it was asked count no rejection."""
    from types import SimpleNamespace

    from engine.request import SpecStats
    from engine.speculative.policy.k_choice import AcceptanceEstimates
    from engine.speculative.proposers.base import Proposal
    from engine.speculative.round_stats import RoundPlan, record_round

    def row(rid):
        return SimpleNamespace(request_id=rid, params=SimpleNamespace(greedy=True), spec=SpecStats())

    est = AcceptanceEstimates()
    reqs = [row("short"), row("whole")]
    plan = RoundPlan(4, "fixed", [4, 4])
    for _ in range(20):
        record_round(reqs, plan, Proposal([[7, 8], [7, 8, 9, 10]], None, ["ngram", "ngram"]), [2, 4], est)
    short, whole = est.rates(["short", "whole"], 4, [("ngram", False)] * 2)
    assert short[0] > 0.95 and short[1] > 0.95 and short[2] < 0.3  # the lookup runs out at 3 (shrunk to the pool)
    assert min(whole) > 0.7 > 0.3 > short[2]
    trees = AcceptanceEstimates()
    for _ in range(20):
        record_round([row("tree")], plan, Proposal([[0, 0]], None, ["ngram"]), [2], trees, chains=False)
    assert trees.rates(["tree"], 3, [("ngram", False)])[0][2] > 0.5  # position 3 never judged: borrowed
