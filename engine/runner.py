"""ContinuousRunner: runs scheduled batches through the target model (plain decode).

One engine step is at most two forward passes: the prefill chunks (padded to the longest
chunk) and the decodes (one token each). The runner owns the target KV pool and implements
the scheduler's `KVAllocator`; the speculative runner extends it.
"""

from __future__ import annotations

import time

import torch

from engine.kv import CachePool, OutOfKVCache
from engine.kv.protocol import power_of_two_at_least
from engine.metrics import DecodeStepStats, PhaseSeconds
from engine.model.llama import Llama
from engine.request import Request
from engine.sampling import greedy_or_sample
from engine.scheduler import ScheduledBatch

_UNPADDED_MAX = 16  # decode and verify passes keep their exact width


def padded_length(t: int) -> int:
    return t if t <= _UNPADDED_MAX else power_of_two_at_least(t)


def width_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` grouped by the power of two at or above each length, shortest first.

    A pass pads every row to its longest chunk, so one long prompt among many short ones would
    make the whole batch that long (50 prompts of ~40 tokens and one of 200: 12,800 rows for
    ~2,200 tokens). Passes over these groups pad no row to more than twice its length."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(power_of_two_at_least(n), []).append(i)
    return [groups[w] for w in sorted(groups)]


def forward_chunks(model: Llama, pool: CachePool, slots: list[int], chunks: list[list[int]],
                   start_positions: list[int], all_logits: bool = False) -> torch.Tensor:
    """Appends chunks[i] at start_positions[i] of slots[i] (which must equal its length).

    Returns logits of each chunk's last token [B, vocab], or of every position [B, T, vocab]
    when all_logits (rows shorter than T are padded; their extra positions are garbage).
    """
    B, T = len(chunks), max(len(c) for c in chunks)
    longest = T
    device = model.device
    if T == 1:  # decode: one token per row
        ids = torch.tensor(chunks, dtype=torch.long)  # [B, 1]
        pos = torch.tensor(start_positions, dtype=torch.long).view(B, 1)  # [B, 1]
    else:
        # long chunks are padded to a power of two: a handful of shapes instead of one per
        # length (every new matmul shape costs kernel memory that is never given back)
        T = padded_length(T)
        ids = torch.zeros(B, T, dtype=torch.long)  # [B, T]
        pos = torch.zeros(B, T, dtype=torch.long)  # [B, T]
        for b, (chunk, start) in enumerate(zip(chunks, start_positions)):
            ids[b, :len(chunk)] = torch.tensor(chunk)
            pos[b, :len(chunk)] = torch.arange(start, start + len(chunk))
    view = pool.view(slots, [len(c) for c in chunks], width=T)
    ids, pos = ids.to(device), pos.to(device)
    if all_logits:
        return model.forward(ids, pos, view, None)[:, :longest]  # [B, longest, vocab]
    if T == 1:
        return model.forward(ids, pos, view, None)[:, 0]  # [B, vocab]
    last = torch.tensor([len(c) - 1 for c in chunks], device=device)  # [B]
    return model.forward(ids, pos, view, last)  # [B, vocab]


class ContinuousRunner:
    def __init__(self, model: Llama, pool: CachePool):
        self.model = model
        self.pool = pool
        self.device = model.device
        self.last_decode: DecodeStepStats | None = None  # what the last step's decode did
        self.last_phases = PhaseSeconds()  # where the last step's time went (the engine fills `other`)

    # --- KVAllocator -------------------------------------------------------------------
    def allocate(self, request: Request) -> bool:
        try:
            slot, cached = self.pool.allocate_slot(request.all_token_ids)
        except OutOfKVCache:
            return False
        request.slot = slot
        request.num_computed_tokens = cached
        request.num_cached_prefix_tokens = cached
        return True

    def reserve(self, request: Request, num_new_tokens: int) -> bool:
        return self.pool.ensure_capacity(request.slot, request.num_computed_tokens + num_new_tokens)

    def free(self, request: Request) -> None:
        if request.slot is not None:
            self.pool.free_slot(request.slot)

    def decode_tokens(self, request: Request) -> int:
        return 1

    # --- forward passes ------------------------------------------------------------------
    def step(self, batch: ScheduledBatch) -> list[tuple[Request, list[int]]]:
        """Runs one scheduled batch; returns the new tokens of each request, in order."""
        out: list[tuple[Request, list[int]]] = []
        self.last_decode = None
        self.last_phases = PhaseSeconds()
        if batch.prefill:
            t0 = time.perf_counter()
            out.extend(self._prefill(batch.prefill))
            self.last_phases.prefill = time.perf_counter() - t0
        if batch.decode:
            out.extend(self._decode(batch.decode))
        return out

    def _prefill(self, chunks: list[tuple[Request, int]]) -> list[tuple[Request, list[int]]]:
        reqs = [r for r, _ in chunks]
        token_chunks = [r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + n] for r, n in chunks]
        logits = torch.empty(len(reqs), self.model.shape.vocab_size, device=self.device)  # [B, vocab]
        for rows in width_groups([len(c) for c in token_chunks]):
            logits[rows] = forward_chunks(self.model, self.pool, [reqs[b].slot for b in rows],
                                          [token_chunks[b] for b in rows],
                                          [reqs[b].num_computed_tokens for b in rows])  # [len(rows), vocab]
        done_rows = []
        for b, (req, n) in enumerate(chunks):
            req.num_computed_tokens += n
            self.pool.register_prefix(req.slot, req.prompt_token_ids)
            if not req.is_prefilling and not req.output_token_ids:
                done_rows.append(b)  # prompt fully in KV: its last logits give the first token
        if not done_rows:
            return []
        done = [reqs[b] for b in done_rows]
        tokens = greedy_or_sample(logits[done_rows], [r.params for r in done],
                                  [r.all_token_ids for r in done], [r.generator for r in done])
        return [(r, [t]) for r, t in zip(done, tokens)]

    def _decode(self, reqs: list[Request]) -> list[tuple[Request, list[int]]]:
        t0 = time.perf_counter()
        logits = forward_chunks(self.model, self.pool, [r.slot for r in reqs],
                                     [[r.output_token_ids[-1]] for r in reqs],
                                     [r.num_computed_tokens for r in reqs])  # [B, vocab]
        for r in reqs:
            r.num_computed_tokens += 1
        tokens = greedy_or_sample(logits, [r.params for r in reqs], [r.all_token_ids for r in reqs],
                                  [r.generator for r in reqs])
        self.last_phases.target += time.perf_counter() - t0
        self.last_decode = DecodeStepStats(batch_size=len(reqs), num_tokens=len(reqs))
        return [(r, [t]) for r, t in zip(reqs, tokens)]

    def kv_usage_fractions(self) -> dict[str, float]:
        return {"target": self.pool.usage_fraction()}

    def free_kv_tokens(self) -> int | None:
        return self.pool.free_token_capacity()
