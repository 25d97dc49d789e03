"""The policy's prices corrected by what the self-check found (Corrections), with shrinkage."""

from __future__ import annotations

import pytest

from engine.speculative.policy.corrections import PRIOR_STEPS, Corrections
from engine.speculative.policy.k_choice import SpecPolicy
from tests.unit.engine.speculative.policy.test_spec_policy import MemoryBoundCosts


def test_a_correction_follows_the_realized_ratio_shrunk_towards_one():
    corrections = Corrections()
    assert corrections.factor(8, 2, "verify") == 1.0  # nothing observed
    corrections.observe(8, 2, {"verify": 1.0, "draft": 0.0, "other": 1.0, "gain": 4.0},
                        {"verify": 1.5, "draft": 0.3, "other": 1.0, "gain": 2.0})
    one = corrections.factor(8, 2, "verify")
    assert one == pytest.approx((1.5 + PRIOR_STEPS) / (1 + PRIOR_STEPS))  # one step: shrunk almost to 1
    assert corrections.factor(8, 2, "draft") == 1.0  # predicted at 0: nothing to scale
    for _ in range(400):
        corrections.observe(8, 2, {"verify": 1.0, "other": 1.0, "gain": 4.0}, {"verify": 1.5, "other": 1.0, "gain": 2.0})
    assert one < corrections.factor(8, 2, "verify") < 1.5 and corrections.factor(8, 2, "verify") > 1.3
    assert 0.5 < corrections.factor(8, 2, "gain") < 0.7 and corrections.factor(8, 2, "other") == pytest.approx(1.0)
    assert corrections.factor(7, 2, "verify") == corrections.factor(8, 2, "verify")  # one batch bucket
    assert corrections.factor(8, 3, "verify") == 1.0 and corrections.factor(16, 2, "verify") == 1.0
    for _ in range(400):
        corrections.observe(1, 1, {"verify": 1.0}, {"verify": 10.0})
    assert corrections.factor(1, 1, "verify") == 2.0  # never beyond the limits


def test_the_policy_leaves_a_k_whose_steps_gain_less_than_it_priced():
    """Priced as the costs say, K = 4 wins at batch 1; once its steps are seen gaining half the
    tokens predicted, the policy takes a smaller K."""
    corrections = Corrections()
    policy = SpecPolicy(MemoryBoundCosts(), spec_length=4, mode="adaptive", hysteresis=0.0, k_probe_every=0,
                        corrections=corrections)
    first = policy.choose([0.8], [100])
    assert first.k == 4
    for _ in range(300):
        corrections.observe(1, 4, {"verify": 1.0, "gain": 2.4}, {"verify": 1.0, "gain": 1.2})
    after = policy.choose([0.8], [100])
    assert 0 < after.k < 4 and after.goodput[4] < first.goodput[4]
