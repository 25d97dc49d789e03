"""Greedy speculative output equals plain greedy output, token for token (fp32)."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.helpers import greedy

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x",
    "for i in range(10):\n    print(i * i)\nfor i in range(10):\n",
    "import os",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "x",
    "print(os.path.join('a', 'b'))\n" * 3,
    "def f():\n    return 1\n",
]



def reference_plan(tiny_model) -> dict:
    """The target's plan as the reference engine measured it (what `forward_plan: auto` chose)."""
    plan = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160).engine.forward_plan["target"]
    return {k: plan[k] for k in ("dtype", "one_sequence_kernel")}


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, max_batch_size=8)
    return [o.token_ids for o in llm.generate(PROMPTS, greedy())]


# draft plans: its torch forward, or token steps (the target's is what the reference measured)
DRAFT_PLANS = {"torch": {"dtype": "float32"}, "token_step": {"dtype": "float32", "token_step": True},
               "bf16_token_step": {"dtype": "bfloat16", "token_step": True}}


@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("method,draft_plan", [("draft", "torch"), ("draft", "token_step"), ("draft", "bf16_token_step"),
                                               ("ngram", "torch"), ("hybrid", "torch"), ("hybrid", "token_step")])
@pytest.mark.parametrize("policy", ["fixed", "adaptive", "per_request"])
def test_speculative_greedy_equals_plain(tiny_model, tiny_draft, reference, backend, method, draft_plan, policy):
    from engine.model.kernels import one_sequence

    if "token_step" in draft_plan and one_sequence.load() is None:
        pytest.skip("the CPU kernels do not build here")
    target = reference_plan(tiny_model)
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
              speculative_method=method, spec_policy="fixed" if policy == "fixed" else "adaptive",
              k_per_request=policy == "per_request", spec_length=4, dtype="float32",
              kv_cache_backend=backend, block_size=4, max_seq_len=160, max_batch_size=8,
              forward_plan={"target": target, "draft": DRAFT_PLANS[draft_plan]})
    alone = [llm.generate(p, greedy())[0] for p in PROMPTS]
    batched = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in alone] == reference
    assert [o.token_ids for o in batched] == reference
    if policy == "fixed":
        drafted = sum(o.num_draft_tokens for o in batched)
        accepted = sum(o.num_accepted_tokens for o in batched)
        assert drafted > 0
        if method == "draft":  # a different random model: acceptance clearly below 1
            assert 0 < accepted < drafted
    assert all(pool.num_used_slots() == 0 for pool in llm.engine.kv.pools().values())


def test_draft_identical_to_target_accepts_everything(tiny_model):
    path = str(tiny_model[0])
    llm = LLM(model=path, draft_model=path, use_speculative_decoding=True, spec_policy="fixed",
              spec_length=4, dtype="float32", max_seq_len=160, forward_plan="torch")
    out = llm.generate(PROMPTS[0], greedy(21))[0]
    assert out.acceptance_rate == 1.0
    assert out.accepted_per_round == [4, 4, 4, 4]  # 4 rounds x 5 tokens, then 1 left: plain
    assert len(out.token_ids) == 21
