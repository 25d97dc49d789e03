"""The draft-model proposer: K batched draft forwards, keeping the adjusted distribution q.

The draft KV pool sits beside the target pool; each request gets a draft slot when it gets
a target slot and loses it at the same time. Draft KV is filled lazily: at each round the
draft first catches up on every known token it has not seen (the whole prompt on the first
round, one or two tokens in steady state, more after n-gram rounds in hybrid mode), in one
batched chunked forward whose last logits give q_1; then K-1 single-token steps.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from engine.kv import CachePool, OutOfKVCache
from engine.model.llama import Llama
from engine.request import Request
from engine.runner import forward_chunks, width_groups
from engine.sampling import SamplingRows, adjusted_probs, context_mask, sample

_LONG_CATCH_UP = 4  # catch-up chunks longer than this run in their own (prefill-like) forward


class DraftProposal(NamedTuple):
    tokens: list[list[int]]  # tokens[i]: the ks[i] drafted tokens of request i
    q: torch.Tensor | None  # [N, max(ks), V] adjusted draft distributions (None unless asked)
    catch_up_seconds: float  # spent feeding long runs of unseen tokens (the lazy draft prefill)
    catch_up_tokens: int  # how many tokens those long runs held
    first_pass_seconds: float  # the steady catch-up pass over a few unseen tokens, giving q_1
    steps: int  # single-token draft forwards after it (max(ks) - 1, fewer if rows finish early)
    steps_seconds: float  # spent on those steps, sampling included


class CatchUp(NamedTuple):
    logits: torch.Tensor  # [N, V] at each request's last known token: q_1 before adjustment
    long_seconds: float  # long (prefill-like) runs of unseen tokens: no part of a steady round
    long_tokens: int
    short_seconds: float  # the pass over short runs: a steady round's first draft pass


class DraftModelProposer:
    name = "draft"

    def __init__(self, model: Llama, pool: CachePool):
        self.model = model
        self.pool = pool
        self._slots: dict[str, int] = {}  # request id -> draft slot

    # --- slot lifecycle (lockstep with the target pool) ----------------------------------
    def allocate(self, req: Request) -> bool:
        try:
            slot, _ = self.pool.allocate_slot([])
        except OutOfKVCache:
            return False
        self._slots[req.request_id] = slot
        return True

    def free(self, req: Request) -> None:
        slot = self._slots.pop(req.request_id, None)
        if slot is not None:
            self.pool.free_slot(slot)

    def reserve(self, req: Request, new_len: int) -> bool:
        return self.pool.ensure_capacity(self._slots[req.request_id], new_len)

    def seq_len(self, req: Request) -> int:
        return self.pool.seq_len(self._slots[req.request_id])

    def rollback(self, req: Request, valid_len: int) -> None:
        """Keeps at most the first valid_len entries (those of accepted tokens)."""
        slot = self._slots[req.request_id]
        self.pool.truncate_to(slot, min(self.pool.seq_len(slot), valid_len))

    def num_used_slots(self) -> int:
        return len(self._slots)

    # --- drafting ----------------------------------------------------------------------
    def unseen_in_long_runs(self, reqs: list[Request]) -> int:
        """Tokens the next round must feed in long (prefill-like) catch-ups: a new request's
        prompt, or what plain steps produced while the draft sat idle."""
        unseen = (r.num_tokens - self.pool.seq_len(self._slots[r.request_id]) for r in reqs)
        return sum(n for n in unseen if n > _LONG_CATCH_UP)

    def _catch_up(self, reqs: list[Request]) -> CatchUp:
        """Feeds each request's unseen tokens, long runs apart from short ones."""
        slots = [self._slots[r.request_id] for r in reqs]
        starts = [self.pool.seq_len(s) for s in slots]
        chunks = [r.all_token_ids[n:] for r, n in zip(reqs, starts)]
        long_rows = [i for i, c in enumerate(chunks) if len(c) > _LONG_CATCH_UP]
        short_rows = [i for i, c in enumerate(chunks) if len(c) <= _LONG_CATCH_UP]
        logits = torch.empty(len(reqs), self.model.shape.vocab_size, device=self.model.device)
        t0 = time.perf_counter()
        for group in width_groups([len(chunks[i]) for i in long_rows]):  # prefill-like: bounded padding
            rows = [long_rows[g] for g in group]
            logits[rows] = forward_chunks(self.model, self.pool, [slots[i] for i in rows],
                                          [chunks[i] for i in rows], [starts[i] for i in rows])
        t1 = time.perf_counter()
        long_seconds = t1 - t0 if long_rows else 0.0
        if short_rows:
            logits[short_rows] = forward_chunks(self.model, self.pool, [slots[i] for i in short_rows],
                                                [chunks[i] for i in short_rows], [starts[i] for i in short_rows])
        return CatchUp(logits, long_seconds, sum(len(chunks[i]) for i in long_rows),
                       time.perf_counter() - t1 if short_rows else 0.0)

    def propose(self, reqs: list[Request], ks: list[int], want_probs: bool) -> DraftProposal:
        """Drafts ks[i] tokens for reqs[i] (all ks > 0), with q [N, max(ks), V] when want_probs."""
        k_max = max(ks)
        rows = SamplingRows.build([r.params for r in reqs], self.model.device) if want_probs else None
        seen = None
        if rows is not None and rows.needs_penalty:
            seen = context_mask([r.all_token_ids for r in reqs], self.model.shape.vocab_size, self.model.device)
        tokens: list[list[int]] = [[] for _ in reqs]
        q_steps: list[torch.Tensor] = []
        caught_up = self._catch_up(reqs)
        logits = caught_up.logits  # [N, V]
        active = list(range(len(reqs)))
        steps, t0 = 0, time.perf_counter()
        for step in range(k_max):
            if rows is None:
                drawn = logits.argmax(dim=-1).tolist()
            else:
                q = adjusted_probs(logits, rows, seen)  # [N, V]
                q_steps.append(q)
                drawn = q.argmax(dim=-1)
                random_rows = [i for i in active if not reqs[i].params.greedy]
                if random_rows:
                    drawn[random_rows] = sample(q[random_rows].cpu(), [reqs[i].generator for i in random_rows]).to(drawn.device)
                if seen is not None:
                    seen.scatter_(1, drawn[:, None], True)
                drawn = drawn.tolist()
            for i in active:
                tokens[i].append(drawn[i])
            active = [i for i in active if len(tokens[i]) < ks[i]]
            if step == k_max - 1 or not active:
                break
            # the next draft step runs only for requests that still need tokens
            step_logits = forward_chunks(self.model, self.pool,
                                         [self._slots[reqs[i].request_id] for i in active],
                                         [[tokens[i][-1]] for i in active],
                                         [self.pool.seq_len(self._slots[reqs[i].request_id]) for i in active])
            if len(active) == len(reqs):
                logits = step_logits  # [N, V]
            else:
                logits = logits.clone()
                logits[active] = step_logits
            steps += 1
        steps_seconds = time.perf_counter() - t0
        q_all = torch.stack(q_steps, dim=1) if q_steps else None  # [N, k_max, V]
        return DraftProposal(tokens, q_all, caught_up.long_seconds, caught_up.long_tokens, caught_up.short_seconds,
                             steps, steps_seconds)
