"""Target features a feature-level proposer (EAGLE-3) has yet to read: per request, the hidden
states the target's passes captured at positions the proposer's head has not consumed.

Contract:
- `append(request_id, start, rows)`: rows [n, F] are the features of target positions
  start..start+n-1. At most `max_pending` rows are kept per request (the oldest go first). A request's rows are contiguous; a start that does not continue them (a
  first pass after a prefix-cache hit or after capture was off) begins a new run, and the run's
  `origin` says where, so the head knows its own positions restart there.
- `truncate_to(request_id, length)` drops rows at positions >= length (rejected verify tokens).
- `take(request_id)` hands over and forgets the pending rows; `restart` moves the reader's
  origin (it started over); `free` forgets the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FeatureRun:
    origin: int  # target position of the run's first row ever (the head's position 0)
    start: int  # target position of the first pending row
    rows: list[torch.Tensor] = field(default_factory=list)  # pending rows, each [n, F], in order
    count: int = 0  # pending rows in all

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class PendingFeatures:
    origin: int
    start: int
    rows: torch.Tensor  # [n, F] features of target positions start..start+n-1


MAX_PENDING = 512  # rows kept per request; past it the oldest go and the reader starts over (memory bound)


class FeatureCache:
    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self._runs: dict[str, FeatureRun] = {}
        self.max_pending = max_pending

    def append(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        """rows are copied: a view would keep the whole pass's features alive."""
        run = self._runs.get(request_id)
        if run is None or run.end != start:
            run = self._runs[request_id] = FeatureRun(origin=start, start=start)
        run.rows.append(rows.clone())
        run.count += rows.shape[0]
        if run.count > self.max_pending:  # keep the newest rows as a new run
            end = run.end
            newest = torch.cat(run.rows)[-self.max_pending:]
            self._runs[request_id] = FeatureRun(end - self.max_pending, end - self.max_pending, [newest], self.max_pending)

    def truncate_to(self, request_id: str, length: int) -> None:
        run = self._runs.get(request_id)
        if run is None or run.end <= length:
            return
        keep, pos = [], run.start
        for r in run.rows:
            if pos + r.shape[0] <= length:
                keep.append(r)
            elif pos < length:
                keep.append(r[:length - pos].clone())
            pos += r.shape[0]
        run.rows = keep
        run.count = sum(r.shape[0] for r in keep)
        if run.start > length:  # nothing left to read and the head is past it: start over there
            self._runs.pop(request_id)

    def end(self, request_id: str) -> int | None:
        """The target position after the request's last row (None: no run)."""
        run = self._runs.get(request_id)
        return None if run is None else run.end

    def clear(self) -> None:
        """Forgets every request's rows (capture stopped: what is kept would go stale)."""
        self._runs.clear()

    def pending(self, request_id: str) -> int:
        run = self._runs.get(request_id)
        return 0 if run is None else run.count

    def take(self, request_id: str) -> PendingFeatures | None:
        run = self._runs.get(request_id)
        if run is None or not run.rows:
            return None
        rows = run.rows[0] if len(run.rows) == 1 else torch.cat(run.rows)
        out = PendingFeatures(run.origin, run.start, rows)
        run.start, run.rows, run.count = run.end, [], 0
        return out

    def restart(self, request_id: str, origin: int) -> None:
        """The reader's position 0 is now target position `origin`."""
        self._runs[request_id].origin = origin

    def free(self, request_id: str) -> None:
        self._runs.pop(request_id, None)
