"""The continuous-batching scheduler against a fake KV manager (token capacity only, no tensors):
chunked prefill under the token budget, decodes first and never split, admission bounded by
slots and KV headroom, preemption of the most recently admitted request, a shared prompt waited for."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.uniforms import RandomStream


class FakeKV:
    """KV bookkeeping by counts: `capacity` tokens in all, a request's reservation its computed
    tokens plus what a step reserved."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: dict[str, int] = {}  # request -> tokens reserved
        self.done: dict[str, int] = {}  # request -> tokens computed

    def allocate(self, request: Request) -> int | None:
        self.held[request.request_id], self.done[request.request_id] = 0, 0
        return 0

    def free(self, request: Request) -> None:
        self.held.pop(request.request_id, None)
        self.done.pop(request.request_id, None)

    def computed(self, request: Request) -> int:
        return self.done.get(request.request_id, 0)

    def _reserve(self, request: Request, total: int) -> bool:
        others = sum(n for rid, n in self.held.items() if rid != request.request_id)
        if others + total > self.capacity:
            return False
        self.held[request.request_id] = max(self.held[request.request_id], total)
        return True

    def reserve_prefill(self, request: Request, num_tokens: int) -> bool:
        return self._reserve(request, self.computed(request) + num_tokens)

    def reserve_decode(self, request: Request, num_tokens: int) -> bool:
        return self._reserve(request, self.computed(request) + num_tokens)

    def free_tokens(self) -> int:
        return self.capacity - sum(self.held.values())


def request(name: str, prompt_len: int) -> Request:
    return Request(name, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=8), RandomStream(0), None)


def run(scheduler: Scheduler, kv: FakeKV):
    """One step: the batch, then what its passes compute (prefill chunks; one token a decode)."""
    batch = scheduler.schedule()
    for req, chunk in batch.prefill:
        kv.done[req.request_id] += chunk
    for req in batch.decode:
        kv.done[req.request_id] += 1
        req.output_token_ids.append(5)
    return batch


def test_prefill_is_chunked_within_the_token_budget_and_decodes_come_first():
    kv = FakeKV(capacity=1000)
    sched = Scheduler(kv, max_batch_size=4, max_num_batched_tokens=8)
    a, b = request("a", 12), request("b", 6)
    sched.add(a)
    sched.add(b)
    first = run(sched, kv)
    assert [(r.request_id, n) for r, n in first.prefill] == [("a", 8)] and not first.decode
    second = run(sched, kv)  # a's last 4 tokens, then b's first 4 within the budget
    assert [(r.request_id, n) for r, n in second.prefill] == [("a", 4), ("b", 4)]
    third = run(sched, kv)  # a decodes (one token of the budget), b finishes its prompt
    assert [r.request_id for r in third.decode] == ["a"] and [(r.request_id, n) for r, n in third.prefill] == [("b", 2)]
    fourth = run(sched, kv)
    assert [r.request_id for r in fourth.decode] == ["a", "b"] and not fourth.prefill


def test_admission_stops_at_max_batch_size_and_at_the_kv_headroom():
    kv = FakeKV(capacity=1000)
    sched = Scheduler(kv, max_batch_size=2, max_num_batched_tokens=100)
    for name in "abc":
        sched.add(request(name, 4))
    run(sched, kv)
    assert [r.request_id for r in sched.running] == ["a", "b"] and [r.request_id for r in sched.waiting] == ["c"]
    tight = FakeKV(capacity=10)  # two 4-token prompts and their next decode round (1 each) fit; a third does not
    sched = Scheduler(tight, max_batch_size=8, max_num_batched_tokens=100)
    for name in "abc":
        sched.add(request(name, 4))
    run(sched, tight)
    assert [r.request_id for r in sched.running] == ["a", "b"]


def test_out_of_kv_preempts_the_latest_admitted_and_admits_nothing_that_step():
    kv = FakeKV(capacity=11)
    sched = Scheduler(kv, max_batch_size=4, max_num_batched_tokens=100, decode_tokens=lambda: 3)
    a, b = request("a", 4), request("b", 4)
    sched.add(a)
    sched.add(b)
    run(sched, kv)  # both prefilled: 8 of 11 tokens
    sched.add(request("c", 1))
    batch = run(sched, kv)  # a's decode round needs 3 more: b (admitted last) goes back to wait
    assert [r.request_id for r in batch.preempted] == ["b"] and [r.request_id for r in batch.decode] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1 and "b" not in kv.held
    assert [r.request_id for r in sched.waiting] == ["b", "c"] and not batch.prefill  # first in line again


def test_the_decode_budget_is_charged_per_decoding_request():
    kv = FakeKV(capacity=1000)
    sched = Scheduler(kv, max_batch_size=8, max_num_batched_tokens=10, decode_tokens=lambda: 5,
                      decode_budget=lambda: 3)
    sched.add(request("a", 2))
    run(sched, kv)
    sched.add(request("b", 20))
    batch = run(sched, kv)  # a decodes (3 of the budget): b's first chunk is the other 7
    assert [r.request_id for r in batch.decode] == ["a"] and [(r.request_id, n) for r, n in batch.prefill] == [("b", 7)]


def test_a_request_sharing_a_prompt_waits_until_that_prompt_is_computed():
    kv = FakeKV(capacity=1000)
    sched = Scheduler(kv, max_batch_size=8, max_num_batched_tokens=6)
    first = request("first", 10)
    second = request("second", 10)
    second.shares_prompt_of = first
    sched.add(first)
    sched.add(second)
    for _ in range(2):  # its prompt is still prefilling (6 tokens, then the last 4)
        run(sched, kv)
        assert [r.request_id for r in sched.running] == ["first"]
    run(sched, kv)
    assert [r.request_id for r in sched.running] == ["first", "second"]
