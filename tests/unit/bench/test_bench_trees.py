"""bench trees' drafting-free ceiling: a tree's rounds priced at the chain's drafting and bookkeeping,
only their target phase their own."""

from __future__ import annotations

import pytest

from bench.trees import _summed, drafting_free_ceiling


def run(tokens, seconds, rounds, prefill, draft, target, other):
    return {"tokens": tokens, "seconds": seconds, "rounds": rounds, "tok_s": tokens / seconds,
            "phases": {"prefill": prefill, "draft": draft, "target": target, "other": other}}


def test_the_ceiling_keeps_the_trees_target_seconds_and_the_chains_drafting_per_round():
    chain = run(100, 1.0, 25, prefill=0.1, draft=0.2, target=0.6, other=0.1)  # 0.012 s a round outside target
    tree = run(100, 1.4, 20, prefill=0.1, draft=0.6, target=0.62, other=0.08)
    # the chain's 1.0 s, its target 0.6 s replaced by the tree's 0.62 s, 5 rounds fewer at 0.012 s each
    assert drafting_free_ceiling(tree, chain) == pytest.approx(1.0 / (1.0 + 0.02 - 5 * 0.012))
    assert tree["tok_s"] / chain["tok_s"] < 1.0 < drafting_free_ceiling(tree, chain)


def test_a_tree_whose_verify_costs_more_than_its_rounds_save_stays_below_one_whatever_its_drafting():
    chain = run(100, 1.0, 25, prefill=0.1, draft=0.2, target=0.6, other=0.1)
    tree = run(100, 1.0, 23, prefill=0.1, draft=0.0, target=0.8, other=0.1)  # drafting free, verify 0.2 s dearer
    assert drafting_free_ceiling(tree, chain) < 1.0


def test_summed_repeats_pool_tokens_seconds_rounds_and_phases():
    a, b = run(10, 1.0, 4, 0.1, 0.2, 0.5, 0.2), run(30, 2.0, 6, 0.2, 0.4, 1.0, 0.4)
    both = _summed([a, b])
    assert (both["tokens"], both["seconds"], both["rounds"], both["tok_s"]) == (40, 3.0, 10, pytest.approx(40 / 3))
    assert both["phases"] == pytest.approx({"prefill": 0.3, "draft": 0.6, "target": 1.5, "other": 0.6})
