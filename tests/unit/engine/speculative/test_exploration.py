"""Exploration under a budget (engine/speculative/exploration.py): the probe schedules' spend
measured at scripted prices, held to 2% of the adaptive steps; a probe's rows; and a probe over
every row recorded into the (B, K + 1) table and the (B, K) time outside the passes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

import tests.unit.engine.speculative.test_spec_pricing as pricing
from engine import LLM, SamplingParams
from engine.speculative.exploration import EXPLORING, SHARE, ExplorationBudget, probe_rows, verdict_k
from engine.speculative.policy.k_choice import Choice
from tests.unit.engine.speculative.test_spec_pricing import _batch, _hybrid_decoder

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "x = [1, 2, 3]\nx = [1, 2, 3]\nx = ["]


def test_the_budget_holds_exploration_to_its_share_whatever_is_asked():
    rng = random.Random(0)
    budget = ExplorationBudget()
    for n in range(1, 5001):
        budget.allow(rng.random() < 0.3)
        assert budget.explored <= SHARE * n + 1
    assert budget.explored + budget.declined == pytest.approx(0.3 * 5000, rel=0.05)
    assert budget.explored >= 0.9 * SHARE * 5000  # credits go unspent only while no step asks
    eager = ExplorationBudget(share=1.0)
    assert all(eager.allow(True) for _ in range(100))


def _reasons(verify_token_s: float, share: float, n: int = 5000, **settings) -> Counter:
    pricing.VERIFY_TOKEN_S = verify_token_s
    try:
        decoder, _ = _hybrid_decoder(**settings)
        decoder.planner.exploration = ExplorationBudget(share)
        reqs = _batch(0)  # every row the lookup's: no draft priced
        return Counter(decoder.planner._plan(reqs, reqs).reason for _ in range(n))
    finally:
        pricing.VERIFY_TOKEN_S = 0.1e-3


def test_the_one_k_schedule_spends_an_eighth_of_a_speculative_stretch_and_the_budget_two_percent():
    """Left to SpecPolicy's schedule, a speculative stretch takes a K probe every 8th choice and
    plain probes further and further apart (12.9% of 5000 steps at these prices); budgeted, at
    most 2% + 1 step explore, the rest run the verdict."""
    free = _reasons(0.1e-3, share=1.0)
    spent = sum(n for reason, n in free.items() if reason in EXPLORING) / 5000
    assert free["k_probe"] > 0.12 * 5000 and spent > 0.12
    capped = _reasons(0.1e-3, share=SHARE)
    assert sum(n for reason, n in capped.items() if reason in EXPLORING) <= SHARE * 5000 + 1
    assert capped["k_probe"] > 0 and capped["policy"] >= free["policy"]


def test_a_plain_stretch_probes_within_the_budget():
    """A plain stretch probes after 32 verdicts, the wait doubling up to 8x: well under 2% of the steps."""
    plain = _reasons(50e-3, share=1.0)
    assert 0 < plain["probe"] <= SHARE * 5000 and set(plain) == {"policy", "probe"}
    per_request = _reasons(50e-3, share=1.0, k_per_request=True)
    assert 0 < per_request["probe"] <= SHARE * 5000


def test_a_probe_speculates_for_every_row_that_needs_no_long_catch_up():
    lags, ks = [0, 9, 2, 30], [3, 3, 3, 3]
    assert probe_rows(ks, lags, [True] * 4, long_catch_up=4) == [3, 0, 3, 0]
    assert probe_rows(ks, lags, [False, False, True, True], long_catch_up=4) == [3, 3, 3, 0]  # lookups: no catch-up
    assert probe_rows(ks, [7, 9, 5, 30], [True] * 4, long_catch_up=4) == [0, 0, 3, 0]  # none: the least behind
    assert probe_rows([0, 0], [0, 0], [True, True], long_catch_up=4) == [0, 0]


def test_a_declined_probe_runs_the_verdict():
    assert verdict_k({0: 5.0, 1: 4.0, 3: 4.5}, last_k=2, k_max=4) == 3  # the best K > 0
    assert verdict_k({}, last_k=6, k_max=4) == 4 and verdict_k({}, last_k=2, k_max=4) == 2


def test_a_probe_over_every_row_feeds_the_tables_the_one_k_plan_reads(tiny_model, tiny_draft):
    """Right after a speculative step the draft lags no row by more than long_catch_up: a probe
    then speculates for every row, and its pass, a (B, K + 1) pass, lands in the padded table and
    the step's time outside the passes at (B, K), as any step of that shape; the output stays plain's."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160).generate(PROMPTS, greedy)
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
              spec_policy="adaptive", spec_length=2, dtype="float32", max_seq_len=160, max_batch_size=4, block_size=4)
    eng = llm.engine
    spec = eng.speculation
    turn = iter(range(10 ** 6))
    spec.planner.policy.choose = lambda *a, **k: Choice(2, "probe", {}) if next(turn) == 2 else Choice(2, "policy", {})
    ids = [eng.add_request(p, greedy) for p in PROMPTS]
    probes = []
    while eng.has_unfinished_requests():
        weights = (spec.costs.target.weight(2, 3), spec.costs.other.weight(2, 2))
        eng.step()
        s = eng.last_step.decode
        if s is not None and s.reason == "probe":
            probes.append(s)
            assert s.row_ks == [2, 2] and s.rows_without_proposal == 0  # both rows proposed
            assert spec.costs.target.weight(2, 3) > weights[0] and spec.costs.other.weight(2, 2) > weights[1]
    assert len(probes) == 1
    assert [eng.get_output(i).token_ids for i in ids] == [o.token_ids for o in reference]
