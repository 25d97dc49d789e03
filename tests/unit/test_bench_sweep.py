"""The batch sweep's held-out comparison: the best fixed variant is picked without the run it is judged on."""

from __future__ import annotations

import pytest

from bench.sweep import held_out_ratios


def test_the_best_fixed_variant_is_picked_on_the_other_repeats():
    """B is lucky in repeat 0 only. Judged on repeat 0, A is picked (best over repeats 1-2), and
    on repeats 1 and 2, B (its lucky run lifts its median over the other two repeats)."""
    runs = {"A": [{"tok_s": 100.0}] * 3,
            "B": [{"tok_s": 130.0}, {"tok_s": 90.0}, {"tok_s": 90.0}],
            "adaptive": [{"tok_s": 105.0}, {"tok_s": 99.0}, {"tok_s": 108.0}]}
    assert held_out_ratios(runs, "adaptive") == pytest.approx([1.05, 1.1, 1.2])
