"""The mixed workload of `bench mixed` (and its serve twin): who is in the batch, sampled how."""

from __future__ import annotations

from bench.mixed import HIGH_TEMPERATURE, batch_of
from bench.workloads import load_prompts


def test_a_mixed_batch_alternates_greedy_edits_and_hot_code():
    prompts, params = batch_of("mix", 4, 0, 16, caps=(4, 0))
    edits, code = load_prompts("edit"), load_prompts("code")
    assert prompts == [edits[0], code[0], edits[1], code[1]]
    assert [p.temperature for p in params] == [0.0, HIGH_TEMPERATURE] * 2
    assert [p.spec_length for p in params] == [4, 0, 4, 0]  # the oracle's fixed K per kind
    assert all(p.max_tokens == 16 and p.ignore_eos for p in params)
    assert batch_of("mix", 4, 1, 16)[0] == [edits[4], code[4], edits[5], code[5]]  # the next repeat: the next prompts


def test_uniform_batches_take_one_pool_and_wrap():
    prompts, params = batch_of("edit", 30, 0, 8)
    edits = load_prompts("edit")
    assert prompts[:len(edits)] == edits and prompts[len(edits):] == edits[:30 - len(edits)]
    assert {p.temperature for p in params} == {0.0}
    assert {p.temperature for p in batch_of("code", 3, 0, 8)[1]} == {HIGH_TEMPERATURE}


def test_the_benches_fixed_settings_follow_a_per_request_variant():
    """bench mixed --oracle and bench serve switch from a K per request to fixed K live: their
    fixed settings turn k_per_request off (fixed with it true is a ValueError)."""
    from bench.common import fixed
    from bench.mixed import ORACLE, PER_REQUEST
    from bench.serve import modes
    from engine.config import SpecConfig

    settings = SpecConfig(draft_model="d", speculative_method="hybrid")
    for caps in ORACLE.values():
        settings = settings.updated(PER_REQUEST).updated(fixed("hybrid", max(caps)))
        assert (settings.spec_policy, settings.k_per_request) == ("fixed", False)
    for name, config in modes([2, 4], {"spec_policy": "adaptive"}).items():
        if name.startswith("K="):
            settings = settings.updated(PER_REQUEST).updated(config)
            assert (settings.spec_policy, settings.k_per_request) == ("fixed", False)
