"""The batch sweep's held-out comparison (the best fixed variant is picked without the run it is
judged on) and its prompts (each repeat of a batch size decodes other prompts)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.batch_run import run_batch
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


class _ScriptedEngine:
    """Plays a scripted run: each step lists (request, finished) outputs and the K it used (None:
    a prefill-only step)."""

    def __init__(self, script):
        self.script, self.last_step = list(script), None

    def add_request(self, prompt, params):
        return prompt

    def has_unfinished_requests(self):
        return bool(self.script)

    def step(self):
        outputs, k = self.script.pop(0)
        self.last_step = SimpleNamespace(phases={"target": 0.001},
                                         decode=None if k is None else SimpleNamespace(k=k))
        return [SimpleNamespace(request_id=rid, finished=done) for rid, done in outputs]

    def get_output(self, rid):
        return SimpleNamespace(num_draft_tokens=0, num_accepted_tokens=0, token_ids=[1])

    def release(self, rid):
        pass


def test_the_window_leaves_out_the_steps_before_the_catch_up_step_and_the_drain():
    """Two requests: a step that starts only one, one that starts the other, the step after it
    (the proposer's catch-up on the prompts, K = 3), two steps with both in flight (the second
    ends one), then a drain step at K = 1 for the other: the window holds the two K = 4 steps."""
    script = [([("a", False)], None), ([("a", False), ("b", False)], 2), ([("a", False), ("b", False)], 3),
              ([("a", False), ("b", False)], 4), ([("a", True), ("b", False)], 4), ([("b", True)], 1)]
    run = run_batch(SimpleNamespace(engine=_ScriptedEngine(script)), ["a", "b"], None)
    assert run["k_steps"] == {2: 1, 3: 1, 4: 2, 1: 1}
    assert run["window_k_steps"] == {4: 2}
    assert run["window_steps"] == 2
