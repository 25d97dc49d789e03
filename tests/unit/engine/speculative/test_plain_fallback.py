"""K = 0 does what plain does (engine/speculative/plain_steps.py), counted: over all-plain adaptive
steps no draft, no feature capture and no planning while the verdict can be reused, as a plain
engine; and coming back, a plan that drafts for rows whose features lapsed is put off one step
that captures them, and the output stays plain's."""

from __future__ import annotations

import math

import pytest

import engine.runner as runner_module
import engine.speculative.plain_steps as plain_steps
from engine import LLM, SamplingParams
from engine.speculative.policy.per_request import REUSE_PLAIN

PROMPTS = ["def add(a, b):\n    return a + b\n\n", "The quick brown fox", "for i in range(10):\n",
           "import numpy as np\n"]
STEPS = 24


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS + 20, ignore_eos=True)


def _counted(eng, monkeypatch) -> dict[str, int]:
    """Counts, from now on, of the proposer's drafting, the features kept and the passes that
    capture them, and the policies' pricing of a verdict."""
    counts = dict.fromkeys(("draft", "features", "capture_passes", "choose"), 0)

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    spec = eng.speculation
    if spec is not None:
        for attr in ("propose", "propose_trees"):
            monkeypatch.setattr(spec.proposer, attr, counting("draft", getattr(spec.proposer, attr)))
        monkeypatch.setattr(spec.planner.policy, "choose", counting("choose", spec.planner.policy.choose))
        monkeypatch.setattr(spec.planner.per_request, "choose", counting("choose", spec.planner.per_request.choose))
    if eng.kv.features is not None:
        monkeypatch.setattr(eng.kv.features, "append", counting("features", eng.kv.features.append))
    monkeypatch.setattr(runner_module, "forward_chunks_features",
                        counting("capture_passes", runner_module.forward_chunks_features))
    return counts


def _decode_steps(eng, n: int) -> list:
    out = []
    for _ in range(n):
        eng.step()
        out.append(eng.last_step.decode)
    return out


def _prefilled(eng) -> list[str]:
    ids = [eng.add_request(p, _greedy()) for p in PROMPTS]
    while not all(eng.get_output(i).token_ids for i in ids):
        eng.step()
    return ids


def _eagle(tiny_model, tiny_head, **policy) -> LLM:
    return LLM(model=str(tiny_model[0]), draft_model=str(tiny_head), use_speculative_decoding=True,
               speculative_method="eagle", spec_policy="adaptive", spec_length=3, dtype="float32", max_seq_len=160,
               max_batch_size=4, **policy)


def _dear_verify(spec, monkeypatch) -> None:
    """Verify passes over more than one token a row priced at 100 s: every verdict is plain."""
    plain = spec.costs.verify_times
    monkeypatch.setattr(spec.costs, "verify_times", lambda batch, k_max: plain(batch, 0)[:1] + [100.0] * k_max)


@pytest.mark.parametrize("policy", [{}, {"k_per_request": True}], ids=["one_k", "per_request"])
def test_an_all_plain_adaptive_step_does_no_more_than_a_plain_engine(tiny_model, tiny_head, monkeypatch, policy):
    """Under a verdict that captures nothing (QUIET; the policy's own plain verdict made one here:
    by default it keeps capturing, test below)."""
    monkeypatch.setattr(plain_steps, "QUIET", plain_steps.QUIET | {"policy"})
    plain = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, max_batch_size=4)
    plain_ids = _prefilled(plain.engine)
    plain_counts = _counted(plain.engine, monkeypatch)
    _decode_steps(plain.engine, STEPS)
    plain_counts = dict(plain_counts)  # (what the next engine's start-up runs is not the plain engine's)

    llm = _eagle(tiny_model, tiny_head, **policy)
    eng = llm.engine
    _dear_verify(eng.speculation, monkeypatch)
    ids = _prefilled(eng)  # prompts are captured: a head needs them when the batch speculates again
    counts = _counted(eng, monkeypatch)
    steps = _decode_steps(eng, STEPS)
    assert all(s.k == 0 and s.reason == "policy" and s.batch_size == 4 for s in steps)
    assert counts["draft"] == plain_counts["draft"] == 0
    assert counts["features"] == plain_counts["features"] == 0
    assert counts["capture_passes"] == plain_counts["capture_passes"] == 0
    # a verdict is priced afresh only once the last one has been reused REUSE_PLAIN times
    assert 1 <= counts["choose"] <= math.ceil(STEPS / (REUSE_PLAIN + 1)) and plain_counts["choose"] == 0
    assert [eng.get_output(i).token_ids for i in ids] == [plain.engine.get_output(i).token_ids for i in plain_ids]


@pytest.mark.parametrize("policy", [{}, {"k_per_request": True}], ids=["one_k", "per_request"])
def test_coming_back_from_a_plain_stretch_captures_first_then_drafts(tiny_model, tiny_head, monkeypatch, policy):
    monkeypatch.setattr(plain_steps, "QUIET", plain_steps.QUIET | {"policy"})  # the policy's verdict lapses them too
    reference = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160,
                    max_batch_size=4).generate(PROMPTS, _greedy())
    llm = _eagle(tiny_model, tiny_head, **policy)
    eng, spec = llm.engine, llm.engine.speculation
    with monkeypatch.context() as m:
        _dear_verify(spec, m)
        ids = _prefilled(eng)
        assert all(s.k == 0 for s in _decode_steps(eng, 12))
    assert spec.planner.stretch.lapsed == set(ids)  # every row's features lapsed while plain
    monkeypatch.setattr(spec.costs, "verify_times", lambda batch, k_max: [0.01] * (k_max + 1))  # now verify is free
    steps = []
    while not steps or steps[-1].k == 0:
        assert len(steps) < 3 * REUSE_PLAIN, [s.reason for s in steps]
        steps += _decode_steps(eng, 1)
    assert steps[-2].reason == "no_proposal" and not spec.planner.stretch.lapsed  # the step that captured them again
    assert steps[-1].rows_without_proposal < steps[-1].batch_size  # then the head drafted from them
    while eng.has_unfinished_requests():
        eng.step()
    assert [eng.get_output(i).token_ids for i in ids] == [o.token_ids for o in reference]


def test_the_policys_plain_verdict_keeps_the_heads_features(tiny_model, tiny_head, monkeypatch):
    """A lapse restarts the head from a short context, whose first rounds accept little, which
    kept the verdict plain (a batch-1 server drafted 0-9 tokens a 64-token request): under the
    policy's own plain verdict the pass keeps capturing, and no row lapses."""
    llm = _eagle(tiny_model, tiny_head)
    eng, spec = llm.engine, llm.engine.speculation
    _dear_verify(spec, monkeypatch)
    _prefilled(eng)
    counts = _counted(eng, monkeypatch)
    assert all(s.k == 0 and s.reason == "policy" for s in _decode_steps(eng, 12))
    assert counts["capture_passes"] > 0 and counts["draft"] == 0 and not spec.planner.stretch.lapsed


def test_a_reused_plain_verdict_keeps_the_probe_schedule(monkeypatch):
    """Reused verdicts count in the one-K policy's probe schedule as the plain choices they stand
    for: the probe comes at the 32nd plain step, as when every step is priced afresh."""
    import tests.unit.engine.speculative.test_spec_pricing as pricing

    monkeypatch.setattr(pricing, "VERIFY_TOKEN_S", 50e-3)  # verify dear: plain verdicts
    reasons, calls = {}, {}
    for reuse in (True, False):
        decoder, _ = pricing._hybrid_decoder()
        reqs = pricing._batch(0)
        calls[reuse] = 0
        choose = decoder.planner.policy.choose

        def counted(*args, _choose=choose, _reuse=reuse):
            calls[_reuse] += 1
            return _choose(*args)

        monkeypatch.setattr(decoder.planner.policy, "choose", counted)
        if not reuse:
            monkeypatch.setattr(decoder.planner.verdicts, "reuse", lambda key, policy: False)
        reasons[reuse] = [decoder.planner._plan(reqs, reqs).reason for _ in range(70)]
    assert reasons[True] == reasons[False] and reasons[True].index("probe") == 31
    assert calls[False] == 70 and calls[True] <= 2 * math.ceil(70 / (REUSE_PLAIN + 1))
