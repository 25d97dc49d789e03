"""The policy's prices corrected by what the self-check found (Corrections), with shrinkage."""

from __future__ import annotations

import pytest

from engine.speculative.policy.corrections import K_STEPS, PRIOR_STEPS, Corrections
from engine.speculative.policy.k_choice import SpecPolicy
from tests.unit.engine.speculative.policy.test_spec_policy import MemoryBoundCosts


def test_a_correction_follows_the_realized_ratio_shrunk_towards_one():
    corrections = Corrections()
    assert corrections.factor(8, 2, "verify") == 1.0  # nothing observed
    corrections.observe(8, 2, {"verify": 1.0, "draft": 0.0, "other": 1.0, "gain": 4.0},
                        {"verify": 1.5, "draft": 0.3, "other": 1.0, "gain": 2.0})
    one = corrections.factor(8, 2, "verify")
    pooled = (1.5 + PRIOR_STEPS) / (1 + PRIOR_STEPS)  # the bucket's K > 0, shrunk towards 1
    assert one == pytest.approx((1.5 + K_STEPS * pooled) / (1 + K_STEPS))  # one step: near the pooled ratio
    assert corrections.factor(8, 2, "draft") == 1.0  # predicted at 0: nothing to scale
    for _ in range(400):
        corrections.observe(8, 2, {"verify": 1.0, "other": 1.0, "gain": 4.0}, {"verify": 1.5, "other": 1.0, "gain": 2.0})
    assert one < corrections.factor(8, 2, "verify") < 1.5 and corrections.factor(8, 2, "verify") > 1.3
    assert 0.5 < corrections.factor(8, 2, "gain") < 0.7 and corrections.factor(8, 2, "other") == pytest.approx(1.0)
    assert corrections.factor(7, 2, "verify") == corrections.factor(8, 2, "verify")  # one batch bucket
    assert corrections.factor(16, 2, "verify") == 1.0 and corrections.factor(8, 0, "verify") == 1.0
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


def test_a_k_not_yet_run_starts_from_what_the_other_ks_of_its_bucket_found():
    """Stale prices are off at every K of a bucket: K = 1's steps taking 1.4x their verify price
    make K = 2 dearer before it runs, and K = 2's own steps then outweigh the pool."""
    corrections = Corrections()
    for _ in range(30):
        corrections.observe(64, 1, {"verify": 1.0, "gain": 10.0}, {"verify": 1.4, "gain": 10.0})
    assert 1.2 < corrections.factor(64, 2, "verify") < 1.4  # borrowed from K = 1
    assert corrections.factor(64, 2, "verify") == pytest.approx(corrections.factor(64, 3, "verify"))
    assert corrections.factor(64, 0, "verify") == 1.0  # plain is corrected by its own steps only
    assert corrections.factor(16, 2, "verify") == 1.0  # another bucket
    for _ in range(60):
        corrections.observe(64, 2, {"verify": 1.0}, {"verify": 1.0})
    assert corrections.factor(64, 2, "verify") < 1.1 < corrections.factor(64, 1, "verify")


def test_the_factors_of_a_choice_are_each_components_factor_by_k():
    """factors(batch, k_max), the policy's one read a choice, holds factor(batch, k, c) for each
    K and component, plain and the pool included, limits applied."""
    corrections = Corrections()
    for k, (verify, gain) in enumerate([(1.2, 1.0), (1.4, 0.8), (0.9, 0.7), (2.6, 0.1)]):
        for _ in range(10 * (k + 1)):
            corrections.observe(16, k, {"verify": 1.0, "other": 1.0, "gain": 2.0}, {"verify": verify, "other": 1.1, "gain": 2 * gain})
    factors = corrections.factors(12, 5)
    assert set(factors) == {"draft", "verify", "other", "gain"}
    for component, row in factors.items():
        assert row == [pytest.approx(corrections.factor(12, k, component)) for k in range(6)]
    assert len(set(factors["verify"][:4])) == 4 and factors["verify"][4] == factors["verify"][5]  # K = 4, 5: the pool's
    assert factors["verify"][0] == pytest.approx((10 * 1.2 + PRIOR_STEPS) / (10 + PRIOR_STEPS), rel=0.05)
