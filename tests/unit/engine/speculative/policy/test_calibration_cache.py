"""The adaptive policy's start-up costs: measured once per fingerprint and read back after (a warm
start runs no calibration pass), batch 1 measured at start and the largest batch when a step
first needs it (plain decoding until then), the running engine's refinements kept in memory, and
an unusable cache re-measured with a warning, never a crash."""

from __future__ import annotations

import json
import logging

import pytest

import engine.speculative.policy.measure as measure_module
from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.speculative.policy.calibration import Calibration, calibration_batches


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "cache" / "costs"
    monkeypatch.setattr("engine.speculative.policy.calibration.cache_dir", lambda: directory)
    return directory


@pytest.fixture
def passes(monkeypatch):
    """Counts calibration passes (each timed forward pass calibration runs)."""
    count = [0]
    original = measure_module.time_pass

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(measure_module, "time_pass", counted)
    return count


def as_json(value):
    return json.loads(json.dumps(value))


def adaptive(tiny_model, tiny_draft, defer: bool = False, **kw) -> LLMEngine:
    config = EngineConfig.from_kwargs(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]),
                                      use_speculative_decoding=True, spec_policy="adaptive", spec_length=3,
                                      dtype="float32", forward_plan="torch",
                                      **{"max_batch_size": 4, "max_seq_len": 160, **kw})
    return LLMEngine(config, defer_calibration=defer)


def test_a_warm_start_reads_the_costs_and_runs_no_calibration_pass(tiny_model, tiny_draft, cache, passes):
    cold = adaptive(tiny_model, tiny_draft)
    first = cold.speculation.planner.calibration
    assert first.source == "measured" and first.passes == passes[0] > 0 and not first.pending
    assert list(cache.glob("*.json")) == [first.path]
    passes[0] = 0
    warm = adaptive(tiny_model, tiny_draft)
    second = warm.speculation.planner.calibration
    assert passes[0] == 0 and second.passes == 0 and second.source == "cached" and not second.pending
    assert as_json(warm.speculation.costs.snapshot()) == as_json(cold.speculation.costs.snapshot())
    assert "calibration" in warm.stats()["startup_s"]


def test_another_fingerprint_measures_again(tiny_model, tiny_draft, cache, passes):
    adaptive(tiny_model, tiny_draft)
    passes[0] = 0
    other = adaptive(tiny_model, tiny_draft, max_batch_size=2)  # the largest batch is part of the fingerprint
    assert other.speculation.planner.calibration.source == "measured" and passes[0] > 0
    assert len(list(cache.glob("*.json"))) == 2


def test_a_deferred_cold_start_decodes_plainly_beyond_batch_one_until_the_largest_batch_is_measured(
        tiny_model, tiny_draft, cache):
    engine = adaptive(tiny_model, tiny_draft, defer=True)
    calibration = engine.speculation.planner.calibration
    assert calibration.pending == [4] and calibration.measured_up_to() == 1
    assert json.loads(calibration.path.read_text())["pending"] == [4]  # written after each batch size
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt in ([5, 9, 30, 7], [6, 2, 2, 8]):
        engine.add_request(prompt, greedy)
    reasons = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step.decode is not None:
            reasons.append(engine.last_step.decode.reason)
    assert reasons and set(reasons) == {"unmeasured"}  # batch 2 > 1: no speculation on a guess
    assert not engine.run_idle_work(1)  # a batch of one needs nothing more
    assert engine.run_idle_work(2) and not calibration.pending
    assert json.loads(calibration.path.read_text())["pending"] == []
    assert not engine.run_idle_work()


def test_a_start_after_a_cold_start_cut_short_measures_only_what_is_missing(tiny_model, tiny_draft, cache,
                                                                           monkeypatch):
    adaptive(tiny_model, tiny_draft, defer=True)  # batch 1 measured and written; batch 4 never
    calls = []
    original = measure_module.calibrate_batch

    def recording(costs, target, draft, max_tokens, batch, *rest):
        calls.append(batch)
        return original(costs, target, draft, max_tokens, batch, *rest)

    monkeypatch.setattr("engine.speculative.policy.calibration.calibrate_batch", recording)
    again = adaptive(tiny_model, tiny_draft).speculation.planner.calibration
    assert calls == [4] and again.source == "cached" and not again.pending


def test_the_running_engines_refinements_stay_in_memory(tiny_model, tiny_draft, cache):
    """Steps refine the table, but the cache keeps what calibration measured: a table learnt under
    a passing load must not price the next start's choices."""
    engine = adaptive(tiny_model, tiny_draft, max_batch_size=1)
    calibration = engine.speculation.planner.calibration
    written = calibration.path.read_text()
    before = as_json(engine.speculation.costs.snapshot())
    engine.add_request([5, 9, 30, 7, 5, 9, 30, 7], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert as_json(engine.speculation.costs.snapshot())["other"] != before["other"]  # refined in memory
    assert calibration.path.read_text() == written


@pytest.mark.parametrize("damage", ["not json", '{"key": {}, "costs": {}}', '{"costs": 1}', "moments", "nan"])
def test_an_unusable_cache_is_measured_again_with_a_warning(tiny_model, tiny_draft, cache, passes, caplog, damage):
    first = adaptive(tiny_model, tiny_draft, max_batch_size=1).speculation.planner.calibration
    if damage in ("moments", "nan"):  # the right shape, a bad value: caught at load, not at the first step
        data = json.loads(first.path.read_text())
        if damage == "moments":
            data["costs"]["catch_up"] = [1.0, 2.0]
        else:
            data["costs"]["target"]["ema"]["1"]["1"] = float("nan")
        damage = json.dumps(data)
    first.path.write_text(damage)
    passes[0] = 0
    with caplog.at_level(logging.WARNING, logger="engine.speculative.policy.calibration"):
        again = adaptive(tiny_model, tiny_draft, max_batch_size=1).speculation.planner.calibration
    assert again.source == "measured" and passes[0] > 0
    assert any("unusable" in r.message for r in caplog.records)
    assert json.loads(again.path.read_text())["key"]  # rewritten


def test_a_restore_of_a_bad_snapshot_leaves_the_costs_as_they_were(tiny_model, tiny_draft, cache):
    costs = adaptive(tiny_model, tiny_draft, max_batch_size=1).speculation.costs
    before = costs.snapshot()
    with pytest.raises(KeyError):
        costs.restore({**before, "draft": {"ema": {}}})
    assert costs.snapshot() == before


def test_the_fingerprint_names_what_timings_depend_on(tiny_model, tiny_draft, cache):
    engine = adaptive(tiny_model, tiny_draft, max_batch_size=1)
    key = engine.speculation.planner.calibration.key
    assert {"host", "torch", "device", "kernels", "target", "draft", "pool", "method", "max_tokens",
            "max_batch"} <= set(key)
    assert key["max_batch"] == 1 and key["max_tokens"] == 9 and key["target"]["plan"]["dtype"] == "float32"
    assert isinstance(engine.speculation.planner.calibration, Calibration)


def test_a_failed_measurement_is_logged_and_never_guessed_past(tiny_model, tiny_draft, cache, monkeypatch, caplog):
    engine = adaptive(tiny_model, tiny_draft, defer=True)
    calibration = engine.speculation.planner.calibration

    def broken(*args, **kwargs):
        raise RuntimeError("no room for the calibration's sequences")

    monkeypatch.setattr("engine.speculative.policy.calibration.calibrate_batch", broken)
    with caplog.at_level(logging.WARNING, logger="engine.speculative.policy.calibration"):
        assert engine.run_idle_work()
    assert calibration.failed == [4] and not calibration.pending and calibration.needs(2) and not calibration.needs(1)
    assert any("failed" in r.message for r in caplog.records)
    assert not engine.run_idle_work()  # not retried


def test_calibration_measures_the_batch_sizes_a_server_runs():
    assert calibration_batches(1) == [1] and calibration_batches(4) == [1, 4]
    assert calibration_batches(32) == [1, 4, 16, 32] and calibration_batches(64) == [1, 4, 16, 64]
    assert calibration_batches(256) == [1, 4, 16, 64, 256]


def test_a_failed_middle_size_is_never_priced_past(tiny_model, tiny_draft, cache, monkeypatch):
    engine = adaptive(tiny_model, tiny_draft, defer=True, max_batch_size=20)
    calibration = engine.speculation.planner.calibration
    assert calibration.pending == [4, 16, 20]
    original = measure_module.calibrate_batch

    def failing_at_four(costs, target, draft, max_tokens, batch, *rest):
        if batch == 4:
            raise RuntimeError("no room")
        return original(costs, target, draft, max_tokens, batch, *rest)

    monkeypatch.setattr("engine.speculative.policy.calibration.calibrate_batch", failing_at_four)
    while engine.run_idle_work():
        pass
    assert calibration.failed == [4] and not calibration.pending
    assert calibration.measured_up_to() == 1 and calibration.needs(2) and calibration.needs(18)
    assert set(calibration.costs.target.batches(1)) == {1, 16, 20}  # measured, never priced past the failure


def test_a_cold_start_prices_a_long_catch_up_before_any_step_reads_a_prompt(tiny_model, tiny_draft, cache,
                                                                          monkeypatch):
    """Unpriced (0 s), the first step weighed reading every prompt as free, chose to speculate, paid
    the catch-up and went plain at once; calibration times two lengths, so the line has a slope.
    The passes run, but each reads as 1 ms + 10 us a token: a loaded host's timings cannot invert
    the two lengths' order (as they did once in CI)."""
    real = measure_module._median_pass

    def linear(model, pool, slots, tokens, *args, **kwargs):
        real(model, pool, slots, tokens, *args, **kwargs)
        return 1e-3 + 1e-5 * tokens
    monkeypatch.setattr(measure_module, "_median_pass", linear)
    engine = adaptive(tiny_model, tiny_draft)
    costs = engine.speculation.costs
    a, b = costs.catch_up.coefficients()
    assert costs.catch_up.varied and b > 0
    assert costs.catch_up_time(1000) > costs.catch_up_time(100) > 0
    warm = adaptive(tiny_model, tiny_draft)  # read back from the cache, line included
    assert warm.speculation.costs.catch_up_time(1000) == pytest.approx(costs.catch_up_time(1000))
