"""The self-check (engine/speculative/self_check.py): every decode step's predicted tokens and
seconds by phase, priced as its plan is, kept next to what it realized per (batch, K chosen), and
exported (engine/metrics.py) as counters and a ratio the dashboard draws."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.metrics import METRIC_BY_NAME, StepMetrics
from engine.speculative.self_check import SelfCheck, plain_prediction, round_prediction
from tests.helpers import InMemoryRecorder
from tests.unit.engine.speculative.test_spec_pricing import (
    CATCH_UP_TOKEN_S,
    DRAFT_ROW_S,
    PLAIN_S,
    VERIFY_TOKEN_S,
    ScriptedCosts,
)

PROMPTS = ["def add(a, b):\n    return a + b\n\n", "The quick brown fox", "for i in range(10):\n",
           "import numpy as np\n"]


def test_a_one_k_round_is_predicted_as_the_one_k_policy_prices_it():
    """Rows 0 and 2 propose 2 tokens at acceptance 0.5 (1.75 tokens expected each), row 1 rides
    along (1): 4.5 tokens; the padded (3, 3) verify pass; drafting two rows at depth 2 (a first
    pass and one further step) and a 10-token catch-up."""
    costs = ScriptedCosts()
    p = round_prediction(costs, [2, 0, 2], [(0.5, 0.5)] * 3, [True] * 3, "own", catch_up_tokens=10)
    assert (p.batch, p.k) == (3, 2) and p.tokens == pytest.approx(4.5)
    assert p.seconds["verify"] == pytest.approx(PLAIN_S + VERIFY_TOKEN_S * 3 * 2)
    assert p.seconds["draft"] == pytest.approx(2 * DRAFT_ROW_S * 2 + 10 * CATCH_UP_TOKEN_S)
    assert costs.draft_rows == [2] and p.seconds["other"] == 0.0
    lookup = round_prediction(ScriptedCosts(), [2, 0, 2], [(0.5, 0.5)] * 3, [False] * 3, "own")
    assert lookup.seconds["draft"] == 0.0  # a lookup's rows run no draft pass


def test_a_per_request_round_is_priced_by_the_tokens_it_verifies():
    """Per request, the packed pass over 3 + 4 tokens is priced between the padded (3, 2) and
    (3, 3) passes (no tokens-and-slots fit yet), at 7 / 3 tokens a row."""
    p = round_prediction(ScriptedCosts(), [2, 0, 2], [(0.5, 0.5)] * 3, [True] * 3, "own", per_request=True,
                         chosen=2)
    assert p.seconds["verify"] == pytest.approx(PLAIN_S + VERIFY_TOKEN_S * 3 * (7 / 3 - 1))
    assert p.seconds["draft"] > 0 and p.tokens == pytest.approx(4.5)
    plain = plain_prediction(ScriptedCosts(), 5)
    assert (plain.k, plain.tokens, plain.seconds) == (0, 5.0, {"draft": 0.0, "verify": PLAIN_S, "other": 0.0})


def test_a_step_not_realized_is_never_recorded():
    check = SelfCheck()
    check.expect(plain_prediction(ScriptedCosts(), 2))
    check.expect(plain_prediction(ScriptedCosts(), 3))  # the last step prefilled too: never realized
    stats = type("Stats", (), {"num_tokens": 3})()
    record = check.realize(stats, 0.0, 0.01, 0.002)
    assert record.predicted.batch == 3 and check.realize(stats, 0.0, 0.01, 0.0) is None
    [row] = check.summary()
    assert (row["batch"], row["k"], row["steps"]) == (3, 0, 1)
    assert row["tokens"]["ratio"] == 1.0 and row["verify"]["ratio"] == pytest.approx(PLAIN_S / 0.01)


@pytest.mark.parametrize("policy", [{"spec_policy": "fixed"}, {"spec_policy": "adaptive"},
                                    {"spec_policy": "adaptive", "k_per_request": True}],
                         ids=["fixed", "adaptive", "per_request"])
def test_every_decode_only_step_keeps_its_prediction_and_the_metrics_agree(tiny_model, tiny_draft, policy):
    """Each step the costs learn from (decode only, no request finishing) is recorded once, its
    realized seconds those of its phases and its realized tokens those it produced; the exported
    counters sum to the summary, the ratio gauge is its ratio, and every label is the metric's."""
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
              spec_length=3, dtype="float32", max_seq_len=160, max_batch_size=4, block_size=4, **policy)
    eng = llm.engine
    spec = eng.speculation
    rec = InMemoryRecorder()
    metrics = StepMetrics(rec, "m")
    observed = []
    observe = spec.observe_step
    spec.observe_step = lambda decoded, phases: (observed.append((decoded.stats.num_tokens, phases.draft
                                                                  + phases.target + phases.other)),
                                                 observe(decoded, phases))
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=16 + 4 * i,
                                          ignore_eos=True))
    while eng.has_unfinished_requests():
        metrics.on_step(eng, eng.step())
    rows = spec.planner.self_check.summary()
    assert eng.stats()["self_check"] == rows and eng.stats()["exploration"]["budget"] == 0.02
    assert observed and sum(r["steps"] for r in rows) == len(observed)
    assert sum(r["tokens"]["realized"] for r in rows) == sum(n for n, _ in observed)
    assert sum(r["seconds"]["realized"] for r in rows) == pytest.approx(sum(s for _, s in observed))
    assert all(r["seconds"]["predicted"] > 0 and r["tokens"]["predicted"] > 0 for r in rows)
    assert rec.total("specserve_spec_realized_tokens_total") == sum(n for n, _ in observed)
    assert rec.total("specserve_spec_predicted_tokens_total") == pytest.approx(sum(r["tokens"]["predicted"] for r in rows))
    assert rec.total("specserve_spec_predicted_seconds_total") == pytest.approx(sum(r["seconds"]["predicted"] for r in rows))
    buckets: dict[tuple[str, str], list[float]] = {}  # the exported batch: the size's power of two
    for r in rows:
        sums = buckets.setdefault((str(1 << (r["batch"] - 1).bit_length()), str(r["k"])), [0.0, 0.0])
        sums[0] += r["tokens"]["predicted"]
        sums[1] += r["tokens"]["realized"]
    for (batch, k), (predicted, realized) in buckets.items():
        key = ("specserve_spec_prediction_ratio", ("batch", batch), ("k", k), ("model", "m"), ("quantity", "tokens"))
        assert rec.gauges[key] == pytest.approx(predicted / realized)
    steps = rec.total("specserve_decode_steps_total")
    assert rec.total("specserve_spec_steps_total") == steps > 0
    for key in list(rec.counters) + list(rec.gauges):
        assert {k for k, _ in key[1:]} == set(METRIC_BY_NAME[key[0]].labels)


def test_a_one_k_round_is_predicted_on_the_lines_its_policy_chose_from():
    """The one-K policy fits its lines over K up to k_max; the round's prediction reads the same
    fits (k_max given), not lines over its own K alone, which differ where the costs bend."""
    from engine.speculative.policy.costs import MeasuredCosts

    costs = MeasuredCosts()
    for t, seconds in enumerate([1.0, 1.2, 1.3, 2.5, 2.6], start=1):  # a step at 4 tokens
        costs.observe_target(2, t, seconds * 1e-2)
    narrow, wide = costs.verify_times(2, 2)[2], costs.verify_times(2, 4)[2]
    assert narrow != pytest.approx(wide)
    p = round_prediction(costs, [2, 2], [(0.5, 0.5)] * 2, [False] * 2, "own", k_max=4)
    assert p.seconds["verify"] == pytest.approx(wide)
    assert round_prediction(costs, [2, 2], [(0.5, 0.5)] * 2, [False] * 2, "own").seconds["verify"] == pytest.approx(narrow)
