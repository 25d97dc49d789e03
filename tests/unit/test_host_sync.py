"""The sync budget: the host reads results back from the device (each read waits for every queued
kernel) once per plain step, and once per draft pass plus once for acceptance per speculative step,
whatever the batch size; sampling and acceptance stay on the device."""

from __future__ import annotations

import pytest

import engine.host_sync as host_sync
from engine import LLM, SamplingParams
from engine.model.kernels import one_sequence


@pytest.fixture
def counted(monkeypatch):
    calls = {"read": 0, "wait": 0}

    def counting(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(host_sync, "read", counting("read", host_sync.read))
    monkeypatch.setattr(host_sync, "wait", counting("wait", host_sync.wait))
    return calls


def _decode_steps(llm: LLM, batch: int, params: SamplingParams, counted: dict, steps: int = 4) -> list[dict]:
    """Reads and waits in each of `steps` decode-only steps once every request has its first token."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request([5 + i, 9, 30, 7, 2 + i], params)
    while any(engine.request(r.request_id).output_token_ids == [] for r in engine.scheduler.running) \
            or engine.num_waiting():
        engine.step()
    per_step = []
    for _ in range(steps):
        before = dict(counted)
        engine.step()
        assert engine.last_step.decode is not None and engine.last_step.phases.prefill == 0
        per_step.append({k: counted[k] - before[k] for k in counted} | {"k": engine.last_step.decode.k})
    return per_step


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_plain_step_reads_back_once_at_any_batch_size(tiny_model, counted, temperature):
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_batch_size=8)
    params = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, repetition_penalty=1.2)
    for batch in (1, 8):
        assert all(s["read"] == 1 and s["wait"] == 0 for s in _decode_steps(llm, batch, params, counted))
        for r in list(llm.engine.scheduler.running):
            llm.engine.abort(r.request_id)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("token_step", [False, True], ids=["torch", "token_step"])
def test_a_speculative_step_reads_back_once_per_draft_pass_and_once_for_acceptance(tiny_model, tiny_draft, counted,
                                                                                   temperature, token_step):
    """K draft passes and acceptance, not per request; a draft on the token step, greedy or at a
    temperature alone, reads its first token only (the rest come from one C call on the host)."""
    k = 3
    if token_step and one_sequence.load() is None:
        pytest.skip("the CPU kernels do not build here")
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
              spec_length=k, spec_policy="fixed", dtype="float32", max_batch_size=8,
              forward_plan={"draft": {"dtype": "float32", "token_step": token_step}})
    params = SamplingParams(temperature=temperature, max_tokens=60, ignore_eos=True)
    reads = 2 if token_step else k + 1
    for batch in (1, 8):
        steps = _decode_steps(llm, batch, params, counted)
        assert all(s["k"] == k for s in steps)
        assert all(s["read"] == reads for s in steps), steps
        assert all(s["wait"] == 1 for s in steps), steps  # the draft's catch-up, timed for the cost model
        for r in list(llm.engine.scheduler.running):
            llm.engine.abort(r.request_id)
