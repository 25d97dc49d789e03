"""The sync budget: the host reads results back from the device (each read waits for every queued
kernel) once per plain step, and once per draft pass plus once for acceptance per speculative step,
whatever the batch size; sampling and acceptance stay on the device. Inputs go the other way only
through host_sync.upload, a bounded number of times per step (the same at batch 1 and 8)."""

from __future__ import annotations

import pytest
import torch

import engine.host_sync as host_sync
from engine import LLM, SamplingParams
from engine.config import ModelPlan
from engine.model.kernels import one_sequence
from engine.model.loader import load_model
from engine.model.passes import forward_chunks, pool_for


@pytest.fixture
def counted(monkeypatch):
    """Calls of host_sync's read, wait and upload, and of torch.tensor with a device (a blocking
    copy on CUDA: the engine builds device tensors through upload or on the device)."""
    calls = {"read": 0, "wait": 0, "upload": 0, "tensor_on_device": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    def tensor(*args, _tensor=torch.tensor, **kwargs):
        if kwargs.get("device") is not None:
            calls["tensor_on_device"] += 1
        return _tensor(*args, **kwargs)

    for name in ("read", "wait", "upload"):
        monkeypatch.setattr(host_sync, name, counting(name, getattr(host_sync, name)))
    monkeypatch.setattr(torch, "tensor", tensor)
    return calls


def _decode_steps(llm: LLM, batch: int, params: SamplingParams, counted: dict, steps: int = 4) -> list[dict]:
    """Calls in each of `steps` decode-only steps once every request has its first token."""
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
    for r in list(engine.scheduler.running):
        engine.abort(r.request_id)
    return per_step


def _uploads_independent_of_batch(by_batch: dict[int, list[dict]]) -> None:
    """Every step uploads, none builds a device tensor with torch.tensor, and batch 1 and 8 upload
    as often per step."""
    for steps in by_batch.values():
        assert all(s["tensor_on_device"] == 0 for s in steps), steps
        assert all(s["upload"] > 0 for s in steps), steps
    uploads = {batch: [s["upload"] for s in steps] for batch, steps in by_batch.items()}
    assert uploads[1] == uploads[8], uploads


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_plain_step_reads_back_once_at_any_batch_size(tiny_model, counted, temperature):
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_batch_size=8)
    params = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, repetition_penalty=1.2)
    by_batch = {batch: _decode_steps(llm, batch, params, counted) for batch in (1, 8)}
    for steps in by_batch.values():
        assert all(s["read"] == 1 and s["wait"] == 0 for s in steps), steps
    _uploads_independent_of_batch(by_batch)


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
    by_batch = {batch: _decode_steps(llm, batch, params, counted) for batch in (1, 8)}
    for steps in by_batch.values():
        assert all(s["k"] == k for s in steps)
        assert all(s["read"] == reads for s in steps), steps
        assert all(s["wait"] == 1 for s in steps), steps  # the draft's catch-up, timed for the cost model
    _uploads_independent_of_batch(by_batch)


def test_a_prefill_chunk_that_completes_no_prompt_waits_for_the_device(tiny_model, counted):
    """Such a chunk reads nothing back, so its passes are waited for inside the prefill (its time
    is the prefill's, not the decode's that follows); a chunk that completes a prompt reads its
    first token back instead."""
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_batch_size=4, max_num_batched_tokens=8)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = engine.add_request(list(range(5, 25)), params)  # 20 prompt tokens: chunks of 8, 8, 4
    seen = []
    while not engine.request(first).output_token_ids:
        before = dict(counted)
        engine.step()
        seen.append((counted["wait"] - before["wait"], counted["read"] - before["read"]))
    assert seen == [(1, 0), (1, 0), (0, 1)]
    second = engine.add_request(list(range(40, 60)), params)  # decodes beside `first`'s steps
    seen = []
    while not engine.request(second).output_token_ids:
        before = dict(counted)
        engine.step()
        seen.append((counted["wait"] - before["wait"], counted["read"] - before["read"]))
    assert seen == [(1, 1), (1, 1), (0, 2)]  # 7 + 7 + 6 prompt tokens, each step beside a decode token


@pytest.mark.parametrize("backend", ["paged", "slotted"])
def test_a_pass_uploads_its_inputs_and_kv_indices_in_one_copy(tiny_model, counted, backend):
    """One upload a pass, at one sequence or several, prefill or decode width."""
    model = load_model(tiny_model[0], ModelPlan("float32"), "cpu", 512)
    pool = pool_for(model, max_slots=4, max_seq_len=512, backend=backend, block_size=4)
    slots = [pool.allocate_slot([])[0] for _ in range(4)]
    lengths = [3, 40, 7, 300]
    for s, n in zip(slots, lengths):
        before = counted["upload"]
        forward_chunks(model, pool, [s], [[1] * n], [0])
        assert counted["upload"] - before <= 2  # the pass; a new row map of more than two blocks
    for chunk in (1, 5):
        for rows in ([slots[0]], slots):
            before = counted["upload"]
            forward_chunks(model, pool, rows, [[2] * chunk] * len(rows), [pool.seq_len(s) for s in rows])
            assert counted["upload"] - before == 1
    assert counted["tensor_on_device"] == 0
