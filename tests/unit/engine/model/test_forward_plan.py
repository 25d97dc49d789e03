"""The forward plan: candidates per role and host, measured once, then read from the cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM
from engine.config import EngineConfig, ModelPlan
from engine.model import plan
from engine.model.kernels import one_sequence
from engine.model.loader import read_shape
from engine.model.token_step import TOKEN_STEP_ROWS
from tests.helpers import make_model


def test_candidates_are_the_paths_that_can_run_here(tiny_model):
    shape = read_shape(tiny_model[0])
    for role, kernel in (("target", "one_sequence_kernel"), ("draft", "token_step")):
        options = plan.candidates(role, "bfloat16", "cpu", shape)
        assert ModelPlan("float32") in options  # float32 represents bf16 weights exactly
        assert (ModelPlan("bfloat16") in options) == plan.onednn_reorders(torch.bfloat16)
        assert all(not getattr(p, other) for p in options
                   for other in {"one_sequence_kernel", "token_step"} - {kernel})  # never the other role's path
        assert plan.candidates(role, "float32", "cpu", shape) == [p for p in options if p.dtype == "float32"]
    assert plan.candidates("target", "bfloat16", "cuda", shape) == [ModelPlan("bfloat16")]  # unmeasured on GPUs
    # bf16 with the one-sequence kernel: a plain-only target's candidate only (the bf16 rule never takes it)
    bf16_kernel = ModelPlan("bfloat16", one_sequence_kernel=True)
    assert bf16_kernel not in plan.candidates("target", "bfloat16", "cpu", shape)
    assert (bf16_kernel in plan.candidates("target", "bfloat16", "cpu", shape, plain=True)) == \
        (plan.onednn_reorders(torch.bfloat16) and one_sequence.load() is not None)
    # how wide a pass the token step takes is measured with it: each width is a candidate of its own
    stepping = [p for p in plan.candidates("draft", "float32", "cpu", shape) if p.token_step]
    assert [p.token_step_rows for p in stepping] == ([] if one_sequence.load() is None else list(TOKEN_STEP_ROWS))
    assert len({plan.label(p) for p in stepping}) == len(stepping)
    # the token step has no attention biases or q/k norms: not a candidate for such a draft
    biased = dataclasses.replace(shape, qkv_bias=True)
    assert not any(p.token_step for p in plan.candidates("draft", "float32", "cpu", biased))


def test_the_winner_is_fastest_over_scenarios_weighted_by_how_often_each_pass_runs():
    """Per shape, a and b tie (each is twice as fast on one of the two); a round at batch 1 runs
    one 2-token catch-up and four steps, so b, fast at steps, wins."""
    ms = {"a": {"1x1": 1.0, "1x2": 1.0}, "b": {"1x1": 0.5, "1x2": 2.0}}
    costs = plan.relative_costs(ms, {"batch 1": [((1, 2), 1), ((1, 1), 4)]})
    assert costs == {"a": pytest.approx(5.0 / 4.0), "b": 1.0}
    two = plan.relative_costs({"a": {"1x1": 1.0, "16x1": 8.0}, "b": {"1x1": 2.0, "16x1": 4.0}},
                              {"batch 1": [((1, 1), 1)], "batch 16": [((16, 1), 1)]})
    assert two["a"] == pytest.approx(2 ** 0.5) and two["b"] == pytest.approx(2 ** 0.5)  # geometric mean


def test_a_plan_is_measured_once_per_fingerprint_then_cached(tmp_path, tok_dir, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    make_model(tmp_path / "m", tok_dir, seed=3, dtype=torch.bfloat16)
    shape = read_shape(tmp_path / "m")
    if len(plan.candidates("draft", "bfloat16", "cpu", shape)) < 2:
        pytest.skip("one candidate path on this host: nothing to measure")
    measured, real = [], plan.measure
    monkeypatch.setattr(plan, "measure", lambda *a, **k: measured.append(a[1]) or real(*a, **k))
    model, choice = plan.load_planned(tmp_path / "m", "draft", "bfloat16", "cpu", 128)
    assert choice.source == "measured" and model.plan == choice.plan and len(measured) == 1
    assert set(choice.ms) == {plan.label(p) for p in plan.candidates("draft", "bfloat16", "cpu", shape)}
    assert len(list((tmp_path / "cache" / "plans").glob("*.json"))) == 1
    again, cached = plan.load_planned(tmp_path / "m", "draft", "bfloat16", "cpu", 128)
    assert (cached.source, cached.plan, again.plan, len(measured)) == ("cached", choice.plan, choice.plan, 1)
    _, as_target = plan.load_planned(tmp_path / "m", "target", "bfloat16", "cpu", 128)  # another role: measured
    assert as_target.source == "measured" and len(measured) == 2
    _, explicit = plan.load_planned(tmp_path / "m", "draft", "bfloat16", "cpu", 128, ModelPlan("float32"))
    assert explicit.source == "explicit" and explicit.plan == ModelPlan("float32") and len(measured) == 2
    # another build of the kernels (changed sources or flags) measures again
    monkeypatch.setattr(one_sequence, "build_digest", lambda: "another-build")
    _, rebuilt = plan.load_planned(tmp_path / "m", "draft", "bfloat16", "cpu", 128)
    assert rebuilt.source == "measured" and len(measured) == 3


def test_a_plain_only_target_is_weighed_by_its_decode_passes(tmp_path, tok_dir, monkeypatch):
    """One measurement of the target's shapes, cached; a speculative engine's target weighs its
    verify passes in, a plain-only one its decode passes alone, and reads the same cache."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    make_model(tmp_path / "m", tok_dir, seed=3, dtype=torch.float32)
    names = [plan.label(p) for p in plan.candidates("target", "float32", "cpu", read_shape(tmp_path / "m"))]
    if len(names) < 2:
        pytest.skip("one candidate path on this host: nothing to weigh")
    fast_verify, fast_decode = names[:2]
    ms = {fast_verify: {"1x1": 2.0, "1x6": 2.0, "16x1": 8.0, "16x6": 10.0},  # the best at verify passes
          fast_decode: {"1x1": 1.0, "1x6": 6.0, "16x1": 6.0, "16x6": 30.0}}  # the best at decode steps
    ms.update({n: {"1x1": 9.0, "1x6": 9.0, "16x1": 90.0, "16x6": 90.0} for n in names[2:]})
    measured = []
    monkeypatch.setattr(plan, "measure", lambda *a, **k: measured.append(1) or ms)
    _, speculative = plan.load_planned(tmp_path / "m", "target", "float32", "cpu", 128)
    _, plain = plan.load_planned(tmp_path / "m", "target", "float32", "cpu", 128, plain=True)
    assert plan.label(speculative.plan) == fast_verify and speculative.source == "measured"
    assert plan.label(plain.plan) == fast_decode and plain.source == "cached" and len(measured) == 1


def test_the_engine_reports_its_plan_and_takes_explicit_ones(tiny_model, tiny_draft):
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
              dtype="float32", max_seq_len=128, forward_plan={"target": {"dtype": "float32"}})
    stats = llm.engine.stats()["forward_plan"]
    assert stats["target"]["source"] == "explicit" and llm.engine.model.plan == ModelPlan("float32")
    assert stats["draft"]["source"] != "explicit"  # a role left out of the mapping is measured
    assert llm.engine.draft_model.plan in plan.candidates("draft", "float32", "cpu", llm.engine.draft_model.shape)
    auto = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=128).engine
    assert auto.forward_plan["target"]["source"] in ("measured", "cached", "unmeasured")
    assert auto.model.plan in plan.candidates("target", "float32", "cpu", auto.model.shape)
    with pytest.raises(ValueError, match="forward_plan.draft: one_sequence_kernel is for the target"):
        EngineConfig(forward_plan={"draft": {"dtype": "float32", "one_sequence_kernel": True}})
    with pytest.raises(ValueError, match="forward_plan token_step_rows"):
        EngineConfig(forward_plan={"draft": {"dtype": "float32", "token_step": True, "token_step_rows": 0}})
    with pytest.raises(ValueError, match=r"unknown forward_plan field\(s\): \['verifier'\]"):
        EngineConfig(forward_plan={"verifier": {}})
