"""Continuous-batching scheduler: admission, chunked prefill under a token budget, preemption.

Each step the scheduler picks (a) the running requests that decode one round and (b) prefill
chunks (new or partially prefilled requests), so that decode tokens + prefill tokens stay
within `max_num_batched_tokens`. Decodes go first (they hold KV and users wait on them). When
the KV pool cannot grow a decode, the most recently admitted request is preempted: its KV is
freed and it goes back to the front of the queue, to be recomputed (prompt + tokens so far)
when there is room again.

The scheduler never touches tensors; KV is reached through the `KVAllocator` it is given.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from engine.request import Request, RequestStatus


class KVAllocator(Protocol):
    """What the scheduler needs from the runner's KV pools."""

    def allocate(self, request: Request) -> bool:
        """Give the request a slot (sets slot and num_computed_tokens from the prefix cache)."""

    def reserve(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of this request; False if out of KV."""

    def free(self, request: Request) -> None: ...

    def decode_tokens(self, request: Request) -> int:
        """Tokens one decode round of this request may write (1 plain; up to K+1 speculative)."""

    def free_kv_tokens(self) -> int | None:
        """Tokens the pools can still take (None: no shared limit, every slot holds a whole sequence)."""


@dataclass
class ScheduledBatch:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk tokens)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, kv: KVAllocator, max_batch_size: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
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
            self.kv.free(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.slot = None

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.slot = None
        victim.status = RequestStatus.WAITING
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        batch.preempted.append(victim)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # 1. decodes of running requests, preempting from the back when KV runs out
        for req in list(self.running):
            if req not in self.running or req.is_prefilling:
                continue
            need = self.kv.decode_tokens(req)  # decodes are never split: budget may go negative
            while not self.kv.reserve(req, need):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            if req in self.running:
                batch.decode.append(req)
                budget -= need
        # 2. continue partial prefills of running requests
        for req in self.running:
            if budget <= 0:
                break
            if req.is_prefilling:
                budget -= self._schedule_chunk(req, budget, batch)
        # 3. admit waiting requests while slots, budget and KV allow. Not in a step that had to
        #    preempt, and a request only if the pools can take all of its tokens still to compute
        #    and leave every running request room for one more decode round: else a request
        #    preempted a moment ago is let back in at once and preempted again (thrashing, every
        #    step recomputing a sequence).
        if batch.preempted:
            return batch
        headroom = sum(self.kv.decode_tokens(r) for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            if not self.kv.allocate(req):
                break
            free = self.kv.free_kv_tokens()
            if free is not None and free < req.num_tokens - req.num_computed_tokens + headroom:
                self.kv.free(req)
                req.slot = None
                req.num_computed_tokens = 0
                break
            headroom += self.kv.decode_tokens(req)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            taken = self._schedule_chunk(req, budget, batch)
            if taken == 0:
                break
            budget -= taken
        return batch

    def _schedule_chunk(self, req: Request, budget: int, batch: ScheduledBatch) -> int:
        target = req.num_tokens - (1 if req.output_token_ids else 0)
        chunk = min(target - req.num_computed_tokens, budget)
        if chunk <= 0 or not self.kv.reserve(req, chunk):
            return 0
        batch.prefill.append((req, chunk))
        return chunk
