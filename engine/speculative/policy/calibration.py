"""The adaptive policy's start-up costs: read from a cache when this engine's fingerprint (host,
torch, device, both models' shapes and plans, pool shape, the widest round, the largest batch) was
measured before, else measured at the batch sizes a server runs (CALIBRATED_BATCHES up to the
largest batch, and the largest: `calibration_batches`), so verify costs between them are
interpolated over a factor of 4 at most. A server measures batch 1 at start and the others, one a
call, when it is first idle, decoding plainly beyond the sizes measured until then.
The running engine's own observations refine the table in memory only: a table learnt under
transient load (another replica starting, a burst) must not price the next start's choices.

Cache: `$SPECSERVE_CACHE/costs/<fingerprint>.json` (default `~/.cache/specserve/costs/`); delete
the folder to re-measure. A missing, corrupt or mismatched file is re-measured with a warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from engine.faults import is_device_fault
from engine.kv import CachePool
from engine.model.kernels import one_sequence
from engine.model.transformer import Transformer
from engine.speculative.policy.costs import MeasuredCosts
from engine.speculative.policy.measure import CALIBRATION_CONTEXT, calibrate_batch

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # part of the fingerprint: bump when what calibration measures changes
CALIBRATED_BATCHES = (1, 4, 16, 64)  # batch sizes measured at start-up (with the largest, capped by it)


def calibration_batches(max_batch: int) -> list[int]:
    """The batch sizes calibration measures for an engine of `max_batch` sequences, smallest first."""
    return sorted({b for b in CALIBRATED_BATCHES if b < max_batch} | {max_batch})


def cache_dir() -> Path:
    return one_sequence.cache_dir().parent / "costs"


def fingerprint(target: Transformer, draft: Transformer | None, pool: CachePool, max_tokens: int,
                max_batch: int, method: str) -> dict:
    """What the measured times depend on (never the weights' values: only their shapes); `method`:
    the proposer, whose own work the refined table's time outside the passes holds."""
    from engine.model.plan import host_info

    def model(m: Transformer | None) -> dict | None:
        return None if m is None else {"shape": repr(m.shape), "plan": dataclasses.asdict(m.plan), "dtype": str(m.dtype),
                                       "row_invariant": getattr(m, "row_invariant", False)}

    device = target.device
    blocks = getattr(pool, "blocks", None)
    return {"version": CACHE_VERSION, "host": host_info(), "torch": torch.__version__, "device": device.type,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "kernels": one_sequence.build_digest(), "target": model(target), "draft": model(draft),
            "pool": {"kind": type(pool).__name__, "block_size": getattr(pool, "block_size", None),
                     "num_blocks": getattr(blocks, "num_blocks", None), "max_seq_len": pool.max_seq_len},
            "method": method, "max_tokens": max_tokens, "max_batch": max_batch, "context": CALIBRATION_CONTEXT,
            **({"cuda_graphs": True} if target.graphs is not None else {}),  # replayed passes cost less
            **({"paged_attention": "inplace"} if target.paged is not None else {})}


class Calibration:
    """One engine's calibration: the cache file its fingerprint names, which batch sizes are still
    to be measured."""

    def __init__(self, costs: MeasuredCosts, target: tuple[Transformer, CachePool],
                 draft: tuple[Transformer, CachePool] | None, max_tokens: int, max_batch: int, method: str,
                 directory: Path | None = None):
        self.costs, self.target, self.draft = costs, target, draft
        self.max_tokens, self.max_batch = max_tokens, max_batch
        self.key = fingerprint(target[0], draft[0] if draft else None, target[1], max_tokens, max_batch, method)
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.path = (directory or cache_dir()) / f"{digest}.json"
        self.pending: list[int] = []  # batch sizes still to measure, smallest first
        self.failed: list[int] = []  # batch sizes whose measurement failed (never retried, never guessed past)
        self.passes = 0  # calibration passes run by this engine
        self.source = "cached"  # "cached", or "measured" once this engine measured anything

    def start(self, defer: bool = False) -> None:
        """Reads the cache, or measures calibration_batches (with `defer`, batch 1 only: the
        others stay pending until run_next)."""
        self.pending = calibration_batches(self.max_batch)
        if self._load():  # a cold start cut short may have left larger batches unmeasured
            if not defer:
                while self.run_next():
                    pass
            return
        self.source = "measured"
        self.run_next()  # batch 1
        while not defer and self.run_next():
            pass

    def needs(self, batch: int) -> bool:
        """Whether a step of `batch` sequences would be priced beyond the batch sizes measured."""
        return bool(self.pending or self.failed) and batch > self.measured_up_to()

    def measured_up_to(self) -> int:
        """The largest batch size calibrated so far with every smaller calibration size too (0:
        none): a failed size is never priced past, even where a larger one was measured."""
        done = 0
        for b in calibration_batches(self.max_batch):
            if b in self.pending or b in self.failed:
                break
            done = b
        return done

    def run_next(self) -> bool:
        """Measures the next pending batch size; False when none was pending. An error other than a
        device fault (which is the replica's end) leaves that size failed: logged, not retried, and
        the policy decodes plainly beyond the sizes measured."""
        if not self.pending:
            return False
        batch = self.pending[0]
        t0 = time.perf_counter()
        try:
            self.passes += calibrate_batch(self.costs, self.target, self.draft, self.max_tokens, batch)
        except Exception as exc:
            if is_device_fault(exc):
                raise
            self.pending.pop(0)
            self.failed.append(batch)
            log.warning("calibrating the adaptive policy's costs at batch %d failed (%s: %s); no speculation "
                        "beyond batch %d", batch, type(exc).__name__, exc, self.measured_up_to())
            return True
        self.pending.pop(0)
        log.info("calibrated the adaptive policy's costs at batch %d in %.2f s%s", batch, time.perf_counter() - t0,
                 f" (pending: batch {self.pending})" if self.pending else "")
        self.save()
        return True

    def save(self) -> None:
        """Writes the table (atomically); a failure is a warning, never an error."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": self.key, "pending": self.pending, "costs": self.costs.snapshot()},
                                      default=str))
            tmp.replace(self.path)
        except OSError as exc:
            log.warning("could not write the calibration cache %s: %s", self.path, exc)

    def _load(self) -> bool:
        if not self.path.exists():
            return False
        try:
            data = json.loads(self.path.read_text())
            if json.loads(json.dumps(self.key, default=str)) != data["key"]:
                raise ValueError("its fingerprint differs from this engine's")
            pending = [int(b) for b in data.get("pending", [])]
            if not set(pending) <= set(self.pending):
                raise ValueError(f"pending batch sizes {pending} are not this engine's")
            self.costs.restore(data["costs"])
            self.pending = pending
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("calibration cache %s is unusable (%s): measuring again", self.path, exc)
            return False
        log.info("adaptive policy's costs read from %s%s", self.path,
                 f" (batch {self.pending} still to measure)" if self.pending else " (no calibration passes)")
        return True
