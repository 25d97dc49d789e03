"""The one-command GPU check (`python -m bench gpu`): sections in priority order, each under its own
time budget with its errors captured, the JSON and a markdown summary rewritten after every section
so a run cut short still reports what it measured.

    python -m bench gpu                          # on the GPU: at most ~9.5 minutes
    python -m bench gpu --device cpu --smoke     # the same code on CPU at toy sizes, under 2 minutes
    python -m bench gpu --out DIR --sections environment correctness
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import RESULTS


class SectionTimeout(Exception):
    """A section ran past its budget."""


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
        return dict(device=self.device, forward_plan="torch", max_batch_size=max_batch_size,
                    max_seq_len=max_seq_len, num_kv_blocks=max_batch_size * -(-max_seq_len // 16) + 1,
                    enable_prefix_caching=False, **kw)

    def free(self) -> None:
        """Returns the memory of engines and models no longer referenced."""
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def check(out: dict, name: str, ok: bool, detail=None) -> bool:
    """Records a pass/fail check of a section (`detail`: what was compared)."""
    out.setdefault("checks", {})[name] = {"ok": bool(ok), **({"detail": detail} if detail is not None else {})}
    return bool(ok)


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


def sections() -> list[tuple[str, Callable[[Context, dict], None], float, float]]:
    """(name, run(ctx, out), budget seconds on the real run, on the smoke run), in priority order."""
    from bench.gpu import attention, correctness, environment, faults, graphs, large, speed, syncs, trees

    return [("environment", environment.run, 15, 20), ("attention", attention.run, 35, 15),
            ("correctness", correctness.run, 110, 70), ("syncs", syncs.run, 30, 20),
            ("llama_1b", speed.run, 170, 40), ("cuda_graphs", graphs.run_graphs, 90, 40),
            ("paged_attention", graphs.run_paged, 90, 60), ("trees", trees.run, 60, 40), ("llama_8b", large.run, 80, 15),
            ("faults", faults.run, 60, 30)]


def device_name(device: str) -> str:
    """A short name for file names: h100, h200, ... or cpu."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    for known in ("h200", "h100", "a100", "l40s", "l4", "a10g", "b200", "gh200"):
        if known in name:
            return known
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def run_sections(ctx: Context, names: list[str] | None, budget: float, write: Callable[[dict], None],
                 scale: float = 1.0) -> dict:
    """Runs the sections (all, or `names`) within `budget` seconds in all, each within its own
    budget times `scale`; writes after each."""
    report = ctx.report
    report.update(device=ctx.device, smoke=ctx.smoke, budget_s=budget, commit=_commit(),
                  date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), sections={})
    for name, fn, full, smoke in sections():
        if names and name not in names:
            continue
        left = budget - (time.perf_counter() - ctx.started)
        out: dict = {}
        report["sections"][name] = out
        if left < 5:
            out.update(status="skipped", reason="the run's time budget is spent")
            write(report)
            continue
        allowed = min(scale * ctx.size(full, smoke), left)
        ctx.log(f"== {name} (budget {allowed:.0f} s)")
        t0 = time.perf_counter()
        ctx.deadline = t0 + allowed
        try:
            with time_limit(allowed):
                fn(ctx, out)
            failed = [k for k, v in out.get("checks", {}).items() if not v["ok"]]
            out["status"] = "failed" if failed else "ok"
            if failed:
                out["failed_checks"] = failed
        except SectionTimeout as exc:
            out.update(status="timeout", error=str(exc))
        except Exception as exc:  # a section's failure must not cost the others
            out.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        out["seconds"] = round(time.perf_counter() - t0, 1)
        ctx.log(f"== {name}: {out['status']} in {out['seconds']} s" + (f" ({out.get('error')})" if out.get("error") else ""))
        with contextlib.suppress(Exception):
            ctx.free()
        write(report)
    return report


def _commit() -> str | None:
    """The checkout's commit (the device's copy may carry no .git: then SPECSERVE_COMMIT, if set)."""
    import os
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = ""
    return head or os.environ.get("SPECSERVE_COMMIT")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--smoke", action="store_true", help="toy sizes: the same code in under 2 minutes on CPU")
    ap.add_argument("--out", default=str(RESULTS), help="where gpu_<device>.json and .md go (default bench/results)")
    ap.add_argument("--sections", nargs="+", help="only these sections (default: all, in priority order)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 570; smoke 250)")
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="multiplies every section's budget (the test suite's slow machines)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: use --device cpu --smoke to check the code on CPU")
    known = [name for name, *_ in sections()]
    if args.sections and set(args.sections) - set(known):
        raise SystemExit(f"unknown section(s) {sorted(set(args.sections) - set(known))}; known: {known}")
    from bench.gpu.summary import markdown

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_{device_name(args.device)}" + ("_smoke" if args.smoke else "")
    budget = args.budget if args.budget is not None else (250 if args.smoke else 570)

    def write(report: dict) -> None:
        (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / f"{stem}.md").write_text(markdown(report))

    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as work:
        ctx = Context(args.device, args.smoke, Path(work))
        report = run_sections(ctx, args.sections, budget, write, args.budget_scale)
    report["seconds"] = round(time.perf_counter() - ctx.started, 1)
    write(report)
    print(markdown(report), flush=True)
    print(f"wrote {out_dir / stem}.json and .md", flush=True)
