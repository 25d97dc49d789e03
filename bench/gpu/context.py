"""What every section of the GPU check gets and records with: the `Context` (device, run size,
scratch directory, clock, the report so far), pass/fail checks, goals, and the section's time limit."""

from __future__ import annotations

import contextlib
import gc
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch


class SectionTimeout(BaseException):
    """A section ran past its budget. A BaseException, so no `except Exception` in the engine or
    in a section swallows it and runs on unbounded."""


@dataclass
class Context:
    """What every section gets: the device, the run's size, a scratch directory, a clock."""

    device: str
    smoke: bool
    work: Path
    started: float = field(default_factory=time.perf_counter)
    report: dict = field(default_factory=dict)  # what the sections before this one found
    deadline: float = float("inf")  # perf_counter time the running section's budget ends

    def left(self) -> float:
        """Seconds left in the running section's budget."""
        return self.deadline - time.perf_counter()

    def size(self, full, smoke):
        """`full` on the real run, `smoke` on the smoke run."""
        return smoke if self.smoke else full

    @property
    def dtype(self) -> str:
        """The speed sections' model dtype: bf16 on a GPU, float32 on CPU (any CPU runs it)."""
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f}s] {message}", flush=True)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], object]) -> tuple[object, float]:
        """fn's result and its wall time in seconds, the device's queued work included."""
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def engine_kwargs(self, max_batch_size: int, max_seq_len: int, **kw) -> dict:
        """LLM keywords for a bench engine on this device, its KV pools sized for exactly
        max_batch_size sequences of max_seq_len (several engines share the card)."""
        block = kw.get("block_size", 16)
        return dict(device=self.device, forward_plan="torch", max_batch_size=max_batch_size,
                    max_seq_len=max_seq_len, num_kv_blocks=max_batch_size * -(-max_seq_len // block) + 1,
                    enable_prefix_caching=False, **kw)

    def free(self) -> None:
        """Returns the memory of engines and models no longer referenced."""
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def check(out: dict, name: str, ok: bool, detail=None) -> bool:
    """Records a pass/fail check of a section: something that must hold wherever it runs."""
    out.setdefault("checks", {})[name] = {"ok": bool(ok), **({"detail": detail} if detail is not None else {})}
    return bool(ok)


def goal(out: dict, name: str, met: bool, value=None) -> bool:
    """Records whether a speed goal was met: judged on a GPU, recorded (never failed) elsewhere."""
    out.setdefault("goals", {})[name] = {"met": bool(met), "value": value}
    return bool(met)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raises SectionTimeout in the main thread after `seconds`."""
    def fire(signum, frame):
        raise SectionTimeout(f"over its {seconds:.0f} s budget")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
