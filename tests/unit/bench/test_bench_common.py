"""bench.common: interleaving alternates the order; each variant keeps its learned state apart (SeparateLearning)."""

from __future__ import annotations

from bench.common import SeparateLearning, adaptive, interleave, interleave_prompts
from engine import LLM, SamplingParams


def test_each_variant_learns_as_if_it_ran_alone(tiny_model):
    """Two variants decoded back to back on one engine: each finds its costs, shape choice and tree
    widths as it left them, and a new variant starts from the engine's state at the start; the
    objects the policy and proposer hold stay the same ones."""
    llm = LLM(model=str(tiny_model[0]), use_speculative_decoding=True, speculative_method="ngram",
              spec_policy="adaptive", spec_length=4, dtype="float32", max_seq_len=256, max_batch_size=4)
    spec = llm.engine.speculation
    costs, shapes = spec.costs, spec.shapes
    learning = SeparateLearning(llm)
    start = dict(spec.shapes.__dict__)
    specs = {"chains": {**adaptive("ngram", 4), "tree_width": 1}, "trees": {**adaptive("ngram", 4), "tree_width": 3}}
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"
    params = lambda r: [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]  # noqa: E731
    runs = interleave_prompts(llm, specs, [prompt], params, 2, "test", learning=learning)
    for run in runs["trees"] + runs["chains"]:  # each phase's seconds counted, within the decode's wall time
        assert run["phases"]["prefill"] > 0 and run["phases"]["target"] > 0
        assert sum(run["phases"].values()) <= run["seconds"]
    assert learning.current in specs
    learning.switch_to("trees")
    trees_state = spec.shapes._sums
    assert trees_state, "the tree variant's rounds were observed"
    learning.switch_to("chains")
    assert spec.shapes._sums == {}  # chains never consult the shape choice: nothing of the trees' rounds
    learning.switch_to("new")
    assert spec.shapes.__dict__ == start  # a new variant starts from the start
    learning.switch_to("trees")
    assert spec.shapes._sums is trees_state
    assert spec.costs is costs and spec.planner.policy.costs is costs and spec.shapes is shapes


def test_interleave_reverses_the_order_every_other_repeat():
    order = []
    runs = interleave({name: (lambda name=name: order.append(name) or {"n": len(order)}) for name in "ABC"}, 3, "t")
    assert "".join(order) == "ABCCBAABC"
    assert [r["n"] for r in runs["A"]] == [1, 6, 7]
