"""The one-command GPU check (`python -m bench gpu`): sections in priority order, each in a child
process under its own time budget (a section past it stops with what it measured; one that hangs
is killed, and the CUDA context of the next is a fresh one), the JSON and a markdown summary
rewritten after every section so a run cut short still reports what it measured.

    python -m bench gpu                          # on the GPU: the default sections, about 6 minutes
    python -m bench gpu --device cpu --smoke     # the same code on CPU at toy sizes
    python -m bench gpu --sections attention syncs faults cuda_graphs   # the others, by name
    python -m bench gpu --sections all           # every section
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import RESULTS

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 20  # past its budget, a child that did not stop by itself (a hang in a kernel) is killed


@dataclass(frozen=True)
class Section:
    name: str
    target: str  # "module:function" under bench.gpu, run(ctx, out)
    budget_s: float  # on the real run
    smoke_s: float  # on the smoke run
    default: bool  # in the default run; else only through --sections


SECTIONS = (  # the default run's order first: what the next GPU session must answer
    Section("environment", "environment:run", 12, 60, True),
    Section("correctness", "correctness:run", 50, 120, True),
    Section("step", "step:run", 45, 120, True),
    Section("realistic_8b", "realistic:run_8b", 100, 150, True),
    Section("paged_attention", "inplace:run", 50, 120, True),
    Section("realistic_1b", "realistic:run_1b", 60, 150, True),
    Section("trees", "trees:run", 35, 150, True),
    Section("suffix", "suffix:run", 30, 150, True),
    Section("attention", "attention:run", 35, 40, False),
    Section("syncs", "syncs:run", 30, 60, False),
    Section("cuda_graphs", "graphs:run_graphs", 90, 120, False),
    Section("llama_1b", "speed:run", 170, 120, False),
    Section("faults", "faults:run", 60, 90, False),
    Section("quantized", "quantized:run", 90, 150, False),
    Section("moe", "moe:run", 150, 200, False),
    Section("per_request", "per_request:run", 90, 150, False),
)


def chosen(names: list[str] | None) -> list[Section]:
    """The sections a run takes: the default ones, every one ("all"), or those named, in order."""
    if not names:
        return [s for s in SECTIONS if s.default]
    if names == ["all"]:
        return list(SECTIONS)
    known = {s.name for s in SECTIONS}
    if set(names) - known:
        raise SystemExit(f"unknown section(s) {sorted(set(names) - known)}; known: {sorted(known)} or all")
    return [s for s in SECTIONS if s.name in names]


def device_name(device: str) -> str:
    """A short name for file names: h100, h200, ... or cpu."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    for known in ("h200", "h100", "a100", "l40s", "l4", "a10g", "b200", "gh200"):
        if known in name:
            return known
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def run_sections(device: str, smoke: bool, work: Path, sections: list[Section], budget: float,
                 write: Callable[[dict], None], scale: float = 1.0) -> dict:
    """Runs `sections` one after another, each in a child process within its own budget times
    `scale` and what is left of `budget`; writes the report after each."""
    started = time.perf_counter()
    report = {"device": device, "smoke": smoke, "budget_s": budget, "commit": _commit(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "sections": {}}
    for section in sections:
        left = budget - (time.perf_counter() - started)
        if left < 5:
            report["sections"][section.name] = {"status": "skipped", "reason": "the run's time budget is spent"}
            write(report)
            continue
        allowed = min(scale * (section.smoke_s if smoke else section.budget_s), left)
        print(f"[{time.perf_counter() - started:6.1f}s] == {section.name} (budget {allowed:.0f} s)", flush=True)
        out = _run_child(section, device, smoke, work, report, allowed, time.perf_counter() - started)
        report["sections"][section.name] = out
        print(f"[{time.perf_counter() - started:6.1f}s] == {section.name}: {out['status']} in {out['seconds']} s"
              + (f" ({out.get('error')})" if out.get("error") else ""), flush=True)
        write(report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def _run_child(section: Section, device: str, smoke: bool, work: Path, report: dict, allowed: float,
               elapsed: float) -> dict:
    """One section in `python -m bench.gpu.child`; its result, or why there is none."""
    report_in, result = work / f"{section.name}.report.json", work / f"{section.name}.result.json"
    report_in.write_text(json.dumps(report, default=str))
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "bench.gpu.child", section.name, device, "1" if smoke else "0",
                              str(work), str(report_in), str(result), str(allowed), str(elapsed)],
                             cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        child.wait(timeout=allowed + GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    seconds = round(time.perf_counter() - t0, 1)
    if result.exists():
        return {**json.loads(result.read_text()), "seconds": seconds}
    return {"status": "killed" if child.returncode in (-9, -signal.SIGKILL) else "error", "seconds": seconds,
            "error": f"the child process ended ({child.returncode}) without a result"}


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
    ap.add_argument("--smoke", action="store_true", help="toy sizes: the same code on CPU in minutes")
    ap.add_argument("--out", default=str(RESULTS), help="where gpu_<device>.json and .md go (default bench/results)")
    ap.add_argument("--sections", nargs="+", help="these sections, or all (default: the default run's, in order)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 440; smoke 1800)")
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="multiplies every section's budget (the test suite's slow machines)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: use --device cpu --smoke to check the code on CPU")
    sections = chosen(args.sections)
    from bench.gpu.summary import markdown

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_{device_name(args.device)}" + ("_smoke" if args.smoke else "")
    budget = args.budget if args.budget is not None else (1800 if args.smoke else 440)

    def write(report: dict) -> None:
        (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / f"{stem}.md").write_text(markdown(report))

    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as work:
        report = run_sections(args.device, args.smoke, Path(work), sections, budget, write, args.budget_scale)
    write(report)
    print(markdown(report), flush=True)
    print(f"wrote {out_dir / stem}.json and .md", flush=True)
