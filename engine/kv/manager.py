"""The one owner of KV bookkeeping: each request's slots in the target pool and, with a draft
model, the draft pool; allocation, reservation, rollback, release and the prefix cache.

- A request holds KV from `allocate` until `free` (finish, abort or preemption); its record is the
  only place its slots live, its computed length the target pool's length of its slot.
- The draft pool fills lazily (the draft proposer), up to the request's tokens (`draft_len`).
- `rollback(request, length)` keeps the first `length` tokens in both pools and the storage the
  round had reserved past them (the next round reserves as much again); shared prefix blocks
  are never released by it.
- With an EAGLE-3 head, the draft pool holds the head's KV and `features` the target features
  it has yet to read (engine/kv/features.py); both are released and rolled back with the rest.
- Proposers and the runner change the pools only through it (`truncate_draft`, `restart_head`,
  `keep_features`, `drop_features`); calibration's scratch slots are its own, freed by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import host_sync
from engine.kv.features import FeatureCache, PendingFeatures
from engine.kv.protocol import CachePool, OutOfKVCache
from engine.request import Request


@dataclass
class SequenceKV:
    """One request's place in the pools."""

    target_slot: int
    draft_slot: int | None


class KVManager:
    def __init__(self, target: CachePool, draft: CachePool | None = None, features: FeatureCache | None = None):
        self.target = target
        self.draft = draft
        self.features = features
        self._records: dict[str, SequenceKV] = {}

    def allocate(self, request: Request) -> int | None:
        """Slots for the request (both pools); returns the tokens served from the prefix cache,
        or None (nothing allocated) when a pool is out of slots or blocks."""
        try:
            # prompt logprobs are computed in prefill: a request asking for them takes nothing from the cache
            slot, cached = self.target.allocate_slot(request.all_token_ids if request.prompt_logprobs is None else [])
        except OutOfKVCache:
            return None
        draft_slot = None
        if self.draft is not None:
            try:
                draft_slot, _ = self.draft.allocate_slot([])
            except OutOfKVCache:
                self.target.free_slot(slot)
                return None
        self._records[request.request_id] = SequenceKV(slot, draft_slot)
        return cached

    def free(self, request: Request) -> None:
        """Releases the request's slots (a no-op when it holds none)."""
        record = self._records.pop(request.request_id, None)
        if record is None:
            return
        self.target.free_slot(record.target_slot)
        if record.draft_slot is not None:
            self.draft.free_slot(record.draft_slot)
        if self.features is not None:
            self.features.free(request.request_id)

    def reserve_prefill(self, request: Request, num_tokens: int) -> bool:
        """Room for num_tokens more prompt tokens in the target pool."""
        record = self._records[request.request_id]
        return self.target.ensure_capacity(record.target_slot, self.computed(request) + num_tokens)

    def reserve_decode(self, request: Request, num_tokens: int) -> bool:
        """Room for a decode round writing num_tokens: in the target pool past its computed
        tokens, and in the draft pool past every token the request has."""
        if not self.reserve_prefill(request, num_tokens):
            return False
        slot = self._records[request.request_id].draft_slot
        return slot is None or self.draft.ensure_capacity(slot, request.num_tokens + num_tokens)

    def rollback(self, request: Request, length: int) -> None:
        """Keeps the first `length` tokens' K/V in both pools, and their storage past it."""
        record = self._records[request.request_id]
        self.target.truncate_to(record.target_slot, length, keep_storage=True)
        if record.draft_slot is not None:
            self.draft.truncate_to(record.draft_slot, min(self.draft.seq_len(record.draft_slot), length),
                                   keep_storage=True)
        if self.features is not None:
            self.features.truncate_to(request.request_id, length)

    def truncate_draft(self, requests: list[Request], lengths: list[int]) -> None:
        """Each request's draft pool back to lengths[i] tokens, keeping the storage past them (a
        proposer drops its draft steps' K/V once the round has its proposal)."""
        for r, n in zip(requests, lengths):
            self.draft.truncate_to(self._records[r.request_id].draft_slot, n, keep_storage=True)

    def restart_head(self, request: Request, start: int) -> None:
        """An EAGLE-3 head starts a new run for the request at target position `start` (capture was
        off for a while): its draft pool empties and its features restart there."""
        self.draft.truncate_to(self._records[request.request_id].draft_slot, 0)
        self.features.restart(request.request_id, start)

    def keep_features(self, requests: list[Request], starts: list[int], features: torch.Tensor,
                      lengths: list[int]) -> None:
        """A target pass's features [B, T, F]: row i's first lengths[i], written from starts[i],
        kept for the head (a request that opted out of speculation never drafts: none)."""
        for i, (r, s, n) in enumerate(zip(requests, starts, lengths)):
            if r.params.spec_length != 0:
                self.features.append(r.request_id, s, features[i, :n])

    def take_features(self, request: Request) -> PendingFeatures | None:
        """The request's features kept since the head last read them, handed over: they leave the
        store; None where there are none."""
        return self.features.take(request.request_id)

    def drop_features(self) -> None:
        """Every request's pending features go (the target stopped capturing them)."""
        if self.features is not None:
            self.features.clear()

    def keep_paths(self, requests: list[Request], starts: list[int], paths: list[list[int]],
                   features: torch.Tensor | None = None) -> None:
        """After a pass over token trees, each written from its start (the root there, node i at
        start + 1 + i): the accepted nodes' target K/V moved to follow the root, in path order,
        for every request in one copy (then `rollback`); with the pass's features [B, T, F],
        those of each root and its accepted nodes go to `self.features` (a request that opted
        out of speculation never drafts: none)."""
        self.target.move_rows([(self._records[r.request_id].target_slot, start + 1 + node, start + 1 + j)
                               for r, start, path in zip(requests, starts, paths) for j, node in enumerate(path)])
        if features is None:
            return
        keep = [(i, r, start, path) for i, (r, start, path) in enumerate(zip(requests, starts, paths))
                if r.params.spec_length != 0]
        if not keep:
            return
        T = features.shape[1]
        at = host_sync.upload([i * T + col for i, _, _, path in keep for col in [0] + [node + 1 for node in path]],
                              features.device, torch.long)  # [M] each root's and accepted node's row
        rows = features.reshape(-1, features.shape[-1]).index_select(0, at)  # [M, F]
        first = 0
        for _, r, start, path in keep:
            self.features.append(r.request_id, start, rows[first:first + len(path) + 1])
            first += len(path) + 1

    def register_prefix(self, request: Request) -> None:
        """Offers the request's computed prompt blocks to the prefix cache."""
        self.target.register_prefix(self._records[request.request_id].target_slot, request.prompt_token_ids)

    def computed(self, request: Request) -> int:
        """Tokens of the request with K/V in the target pool (0 when it holds none)."""
        record = self._records.get(request.request_id)
        return 0 if record is None else self.target.seq_len(record.target_slot)

    def target_slot(self, request: Request) -> int:
        return self._records[request.request_id].target_slot

    def draft_slot(self, request: Request) -> int:
        return self._records[request.request_id].draft_slot

    def draft_len(self, request: Request) -> int:
        return self.draft.seq_len(self.draft_slot(request))

    def free_tokens(self) -> int | None:
        """Tokens every pool can still take (None: no shared limit, a slot holds a whole sequence)."""
        known = [n for n in (p.free_token_capacity() for p in self.pools().values()) if n is not None]
        return min(known) if known else None

    def pools(self) -> dict[str, CachePool]:
        return {"target": self.target} if self.draft is None else {"target": self.target, "draft": self.draft}

    def usage(self) -> dict[str, float]:
        """Fraction of each pool's blocks in use."""
        return {name: pool.usage_fraction() for name, pool in self.pools().items()}

    def counts(self) -> dict[str, int | None]:
        """Slots and blocks in use per pool."""
        out: dict[str, int | None] = {}
        for name, pool in self.pools().items():
            out[f"{name}_kv_used_slots"] = pool.num_used_slots()
            out[f"{name}_kv_used_blocks"] = pool.num_used_blocks()
        return out
