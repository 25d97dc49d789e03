"""Continuous-batching scheduler: admission, chunked prefill under a token budget, preemption.

Each step: the running requests' decodes first (never split; the most recently admitted request
is preempted, its KV freed for recompute, when the pools cannot grow a decode), then prefill
chunks within `max_num_batched_tokens`. It never touches tensors; KV goes through its KVManager.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv import KVManager
from engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk tokens)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, kv: KVManager, max_batch_size: int, max_num_batched_tokens: int,
                 decode_tokens: Callable[[], int] = lambda: 1, decode_budget: Callable[[], int] | None = None):
        """decode_tokens(): KV tokens one decode round of a request may write (1 plain, up to
        K + 1 speculative, a tree's nodes + 1): the KV room reserved. decode_budget(): tokens a
        decode round is expected to compute (what the speculation chose last; at most
        decode_tokens()), charged to the step's token budget; default decode_tokens(). Charging
        the worst case there would leave prefills no budget once a few dozen requests decode,
        capping the batch well below max_batch_size."""
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_tokens = decode_tokens
        self.decode_budget = decode_budget or decode_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Drops a request (finished or aborted) and frees its KV."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)

    def is_prefilling(self, request: Request) -> bool:
        return self.kv.computed(request) < request.num_prefill_tokens

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens - self._schedule_decodes(batch)
        for req in self.running:  # continue partial prefills
            if budget <= 0:
                break
            if self.is_prefilling(req):
                budget -= self._schedule_chunk(req, budget, batch)
        if not batch.preempted:
            self._admit(budget, batch)
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch) -> int:
        """Running requests that decode this step, preempting from the back when KV runs out;
        returns the budget they take (decodes are never split: the budget may go negative)."""
        need = self.decode_tokens()
        for req in list(self.running):
            if req not in self.running or self.is_prefilling(req):
                continue
            while not self.kv.reserve_decode(req, need):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            if req in self.running:
                batch.decode.append(req)
        return self.decode_budget() * len(batch.decode)

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        batch.preempted.append(victim)

    def _admit(self, budget: int, batch: ScheduledBatch) -> None:
        """Admits waiting requests while slots, budget and KV allow: a request only if the pools
        can take all of its tokens still to compute and leave every running request room for
        one more decode round (else one preempted a moment ago would thrash back in). Never in
        a step that preempted."""
        headroom = self.decode_tokens() * len(self.running)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            if self._prompt_pending(req):
                break  # its sibling's prompt is still being computed: it will read it from the prefix cache
            cached = self.kv.allocate(req)
            if cached is None:
                break
            free = self.kv.free_tokens()
            if free is not None and free < req.num_tokens - cached + headroom:
                self.kv.free(req)
                break
            req.num_cached_prefix_tokens = cached
            headroom += self.decode_tokens()
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            taken = self._schedule_chunk(req, budget, batch)
            if taken == 0:
                break
            budget -= taken

    def _prompt_pending(self, req: Request) -> bool:
        """Whether the request whose prompt `req` shares (n > 1) is queued or still prefilling."""
        first = req.shares_prompt_of
        if first is None or first.is_finished:
            return False
        return first.status is RequestStatus.WAITING or self.is_prefilling(first)

    def _schedule_chunk(self, req: Request, budget: int, batch: ScheduledBatch) -> int:
        chunk = min(req.num_prefill_tokens - self.kv.computed(req), budget)
        if chunk <= 0 or not self.kv.reserve_prefill(req, chunk):
            return 0
        batch.prefill.append((req, chunk))
        return chunk
