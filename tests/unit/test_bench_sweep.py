"""The batch sweep's held-out comparison (the best fixed variant is picked without the run it is
judged on) and its prompts (each repeat of a batch size decodes other prompts)."""

from __future__ import annotations

import pytest

from bench.sweep import held_out_ratios, repeat_prompts


def test_the_best_fixed_variant_is_picked_on_the_other_repeats():
    """B is lucky in repeat 0 only. Judged on repeat 0, A is picked (best over repeats 1-2), and
    on repeats 1 and 2, B (its lucky run lifts its median over the other two repeats)."""
    runs = {"A": [{"tok_s": 100.0}] * 3,
            "B": [{"tok_s": 130.0}, {"tok_s": 90.0}, {"tok_s": 90.0}],
            "adaptive": [{"tok_s": 105.0}, {"tok_s": 99.0}, {"tok_s": 108.0}]}
    assert held_out_ratios(runs, "adaptive") == pytest.approx([1.05, 1.1, 1.2])


def test_each_repeat_takes_the_next_prompts_of_the_pool_wrapping():
    pool = [f"p{i}" for i in range(5)]
    assert [repeat_prompts(pool, 1, r) for r in range(6)] == [["p0"], ["p1"], ["p2"], ["p3"], ["p4"], ["p0"]]
    assert [repeat_prompts(pool, 2, r) for r in range(3)] == [["p0", "p1"], ["p2", "p3"], ["p4", "p0"]]
    assert repeat_prompts(pool, 5, 1) == pool  # the whole pool: every repeat decodes all of it
