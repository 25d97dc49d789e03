"""AsyncLLMEngine: streaming, cancellation, errors, health."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from serve_app.async_engine import AsyncLLMEngine, EngineDeadError


def config(path, **kw):
    return EngineConfig(**{**dict(model=str(path), dtype="float32", max_seq_len=160, block_size=4), **kw})


def test_streams_match_offline_generation_and_cancel_frees_kv(tiny_model):
    prompts = ["def add(a, b):", "import os", "class A:"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(tiny_model[0]), dtype="float32",
                                         max_seq_len=160).generate(prompts, params)]
    aeng = AsyncLLMEngine(config(tiny_model[0]))

    async def collect(prompt):
        tokens, deltas, final = [], 0, None
        async for d in aeng.generate(prompt, params):
            tokens += d.token_ids
            deltas += 1
            final = d
        return tokens, deltas, final

    async def cancel_midway(prompt):
        async for d in aeng.generate(prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)):
            if len(d.token_ids) and d.finished is False:
                break  # consumer goes away -> request aborted

    async def main():
        results = await asyncio.gather(*(collect(p) for p in prompts), *(cancel_midway(p) for p in prompts))
        usage = await aeng.call(lambda e: (e.kv.target.num_used_blocks(), e.has_unfinished_requests()))
        return results, usage

    results, usage = asyncio.run(main())
    for (tokens, deltas, final), exp in zip(results[:3], expected):
        assert tokens == exp
        assert deltas > 1 and final.finished and final.output.token_ids == exp
    assert usage == (0, False)
    aeng.shutdown()


def test_bad_input_raises_before_streaming_and_others_continue(tiny_model):
    aeng = AsyncLLMEngine(config(tiny_model[0]))

    async def main():
        with pytest.raises(ValueError, match="max_seq_len"):
            async for _ in aeng.generate("x", SamplingParams(max_tokens=10_000)):
                pass
        out = []
        async for d in aeng.generate("x", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)):
            out += d.token_ids
        return out

    assert len(asyncio.run(main())) == 5
    aeng.shutdown()


def test_dead_engine_loop_fails_health(tiny_model):
    aeng = AsyncLLMEngine(config(tiny_model[0]))
    aeng.check_health()

    def boom():
        raise SystemExit("injected: loop killed")

    aeng.engine.has_unfinished_requests = boom  # the loop's own machinery breaks
    aeng._wake.set()
    aeng._thread.join(timeout=10)
    with pytest.raises(EngineDeadError, match="injected"):
        aeng.check_health()


def test_a_stream_closed_before_its_first_delta_aborts_its_request(tiny_model):
    """A client that disconnects before reading anything (the server sends a first SSE chunk
    before iterating) must not leave its request running to max_tokens."""
    aeng = AsyncLLMEngine(config(tiny_model[0]))

    async def main():
        stream = await aeng.add("def add(a, b):", SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
        await stream.aclose()
        # commands run in order on the engine thread: the abort has been processed by now
        return await aeng.call(lambda e: (e.request(stream.request_id), e.has_unfinished_requests(),
                                          e.kv.target.num_used_slots()))

    assert asyncio.run(main()) == (None, False, 0)  # aborted and released, nothing holds KV
    aeng.shutdown()


def test_a_device_fault_stops_the_loop_fails_every_request_and_fails_health(tiny_model):
    """A sticky device error (here a simulated CUDA illegal access in one request's step) is not
    one request's problem: every in-flight request fails with a clear error, the loop stops and
    the health check fails, so Serve replaces the replica. An ordinary error stays isolated."""
    from engine.faults import is_device_fault

    assert is_device_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_fault(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_device_fault(RuntimeError("shape mismatch")) and not is_device_fault(ValueError("CUDA error"))
    aeng = AsyncLLMEngine(config(tiny_model[0]))

    def fault(request):
        if request.request_id == "bad" and len(request.output_token_ids) >= 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    aeng.engine.fault_hook = fault
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        others = [await aeng.add("def add(a, b):", params) for _ in range(2)]
        bad = await aeng.add("x", params, request_id="bad")
        results = []
        for stream in [*others, bad]:
            try:
                async for _ in stream:
                    pass
                results.append("finished")
            except EngineDeadError as exc:
                results.append(str(exc))
        return results

    results = asyncio.run(main())
    assert all("device fault" in r and "illegal memory access" in r for r in results), results
    with pytest.raises(EngineDeadError, match="device fault"):
        aeng.check_health()


def test_a_cold_server_start_measures_the_largest_batch_in_its_first_idle_moment(tiny_model, tiny_draft, tmp_path,
                                                                               monkeypatch):
    """The serving engine starts with batch 1 calibrated; the loop measures the largest batch before
    it next waits for work (each `call` runs on the loop between iterations)."""
    import threading

    import engine.speculative.policy.calibration as calibration_module

    monkeypatch.setattr("engine.speculative.policy.calibration.cache_dir", lambda: tmp_path)
    measured = []  # (batch, thread)
    original = calibration_module.calibrate_batch

    def recording(costs, target, draft, max_tokens, batch, *rest):
        measured.append((batch, threading.current_thread().name))
        return original(costs, target, draft, max_tokens, batch, *rest)

    monkeypatch.setattr(calibration_module, "calibrate_batch", recording)
    aeng = AsyncLLMEngine(config(tiny_model[0], max_batch_size=4, speculative=dict(
        use_speculative_decoding=True, draft_model=str(tiny_draft[0]), spec_policy="adaptive", spec_length=3)))

    async def pending_after_calls(n):
        return [await aeng.call(lambda e: list(e.speculation.planner.calibration.pending)) for _ in range(n)]

    seen = asyncio.run(pending_after_calls(3))
    assert seen[-1] == [] and all(p in ([4], []) for p in seen), seen
    assert aeng.engine.speculation.planner.calibration.measured_up_to() == 4
    assert measured == [(1, threading.current_thread().name), (4, "engine-loop")]  # at start, then while idle
    aeng.shutdown()
