"""The one-command GPU check (`python -m bench gpu`): sections in the order given, each in a child
process under its own time budget counted from the child's launch (its python and torch start-up
included; a section past it stops with what it measured; one that hangs is killed, and the CUDA
context of the next is a fresh one), the JSON and a markdown summary rewritten after every section
so a run cut short still reports what it measured.

    python -m bench gpu --plan first             # on the GPU (the default): 6 sections in 480 s, start-ups included
    python -m bench gpu --plan second            # the rest of what a GPU must answer: 5 sections
    python -m bench gpu --device cpu --smoke     # the same code on CPU at toy sizes
    python -m bench gpu --sections quantized correctness   # these sections, in this order
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
from bench.gpu.summary import budget_line, markdown

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 20  # past its budget, a child that did not stop by itself (a hang in a kernel) is killed


@dataclass(frozen=True)
class Section:
    name: str
    target: str  # "module:function" under bench.gpu, run(ctx, out)
    budget_s: float  # on the real run, through --sections (a plan sets its own)
    smoke_s: float  # on the smoke run


SECTIONS = (
    Section("environment", "environment:run", 12, 60),
    Section("correctness", "correctness:run", 70, 150),
    Section("step", "step:run", 45, 120),
    Section("realistic_8b", "realistic:run_8b", 100, 150),
    Section("paged_attention", "inplace:run", 50, 120),
    Section("realistic_1b", "realistic:run_1b", 60, 150),
    Section("trees", "trees:run", 35, 150),
    Section("suffix", "suffix:run", 30, 150),
    Section("attention", "attention:run", 35, 40),
    Section("syncs", "syncs:run", 30, 60),
    Section("cuda_graphs", "graphs:run_graphs", 90, 120),
    Section("llama_1b", "speed:run", 170, 120),
    Section("faults", "faults:run", 60, 90),
    Section("quantized", "quantized:run", 90, 150),
    Section("moe", "moe:run", 150, 200),
    Section("per_request", "per_request:run", 90, 150),
)
BY_NAME = {s.name: s for s in SECTIONS}
STARTUP_S = 10  # allowed a child for python, torch and the section's imports before its work (~3 s on an H200)


@dataclass(frozen=True)
class Plan:
    """A named run: sections in the order of what they settle, each with its budget on the GPU
    (seconds of work), within `total_s` counting STARTUP_S a child on top of each budget."""

    name: str
    budgets: tuple[tuple[str, float], ...]
    total_s: float

    @property
    def sections(self) -> list[Section]:
        return [BY_NAME[name] for name, _ in self.budgets]

    def accounting(self, startup_s: float = STARTUP_S) -> dict:
        """Each section's budget, its start-up allowance and their sums against the plan's total."""
        rows = {name: {"run_s": b, "startup_s": startup_s, "allotted_s": b + startup_s} for name, b in self.budgets}
        total = sum(r["allotted_s"] for r in rows.values())
        return {"plan": self.name, "sections": rows, "run_sum_s": sum(b for _, b in self.budgets),
                "startup_sum_s": startup_s * len(rows), "sum_s": total, "total_s": self.total_s,
                "fits": total <= self.total_s}


PLANS = {  # trimmed from SECTIONS' budgets so that the first fits one GPU call (<= 9 minutes with the machine's start)
    "first": Plan("first", (("environment", 10), ("correctness", 70), ("step", 45), ("realistic_8b", 90),
                            ("quantized", 80), ("moe", 125)), 480),
    "second": Plan("second", (("paged_attention", 50), ("realistic_1b", 60), ("trees", 35), ("suffix", 30),
                              ("per_request", 90)), 480),
}
DEFAULT_PLAN = "first"


def chosen(names: list[str] | None) -> list[Section]:
    """The sections a run takes: the default plan's, every one ("all"), or those named, in the order named."""
    if not names:
        return PLANS[DEFAULT_PLAN].sections
    if names == ["all"]:
        return list(SECTIONS)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; known: {sorted(BY_NAME)} or all")
    return [BY_NAME[n] for n in dict.fromkeys(names)]  # the order given, each once


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
                 write: Callable[[dict], None], scale: float = 1.0, plan: Plan | None = None,
                 startup_s: float = STARTUP_S) -> dict:
    """Runs `sections` one after another in that order, each in a child process within its budget
    (the plan's on a real plan run, else the section's; times `scale`), plus `startup_s` for the
    child's start, and what is left of `budget`; writes the report after each."""
    started = time.perf_counter()
    budgets = dict(plan.budgets) if plan is not None and not smoke else {}
    run_s = {s.name: scale * (s.smoke_s if smoke else budgets.get(s.name, s.budget_s)) for s in sections}
    accounting = {"plan": plan.name if plan is not None else None,
                  "sections": {n: {"run_s": round(b, 1), "startup_s": startup_s, "allotted_s": round(b + startup_s, 1)}
                               for n, b in run_s.items()},
                  "run_sum_s": round(sum(run_s.values()), 1), "startup_sum_s": startup_s * len(run_s),
                  "sum_s": round(sum(run_s.values()) + startup_s * len(run_s), 1), "total_s": budget}
    accounting["fits"] = accounting["sum_s"] <= budget
    report = {"device": device, "smoke": smoke, "budget_s": budget, "commit": _commit(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "plan": accounting["plan"],
              "order": [s.name for s in sections], "budget": accounting, "sections": {}}
    if plan is not None:
        report["plan_accounting"] = plan.accounting(startup_s)  # the GPU run's, whatever this run's size
    print("budget: " + budget_line(accounting), flush=True)
    for section in sections:
        left = budget - (time.perf_counter() - started)
        if left < 5:
            report["sections"][section.name] = {"status": "skipped", "reason": "the run's time budget is spent"}
            write(report)
            continue
        allowed = min(run_s[section.name] + startup_s, left)
        print(f"[{time.perf_counter() - started:6.1f}s] == {section.name} (budget {allowed:.0f} s, start-up included)",
              flush=True)
        out = _run_child(section, device, smoke, work, report, allowed, time.perf_counter() - started)
        out["allotted_s"] = round(allowed, 1)
        report["sections"][section.name] = out
        print(f"[{time.perf_counter() - started:6.1f}s] == {section.name}: {out['status']} in {out['seconds']} s"
              + (f" (start-up {out['startup_s']} s)" if "startup_s" in out else "")
              + (f" ({out.get('error')})" if out.get("error") else ""), flush=True)
        write(report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def _run_child(section: Section, device: str, smoke: bool, work: Path, report: dict, allowed: float,
               elapsed: float) -> dict:
    """One section in `python -m bench.gpu.child`, within `allowed` seconds from its launch (the
    child measures its own start-up against them); its result, or why there is none."""
    report_in, result = work / f"{section.name}.report.json", work / f"{section.name}.result.json"
    report_in.write_text(json.dumps(report, default=str))
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "bench.gpu.child", section.name, device, "1" if smoke else "0",
                              str(work), str(report_in), str(result), str(allowed), str(elapsed), repr(time.time())],
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
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--plan", choices=sorted(PLANS),
                       help=f"a named run: {'; '.join(f'{p.name}: ' + ', '.join(n for n, _ in p.budgets) for p in PLANS.values())}"
                            f" (default {DEFAULT_PLAN})")
    which.add_argument("--sections", nargs="+", help="these sections in this order, or all")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default: the plan's total, 480; --sections 440; smoke 1800)")
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="multiplies every section's budget (the test suite's slow machines)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: use --device cpu --smoke to check the code on CPU")
    plan = None if args.sections else PLANS[args.plan or DEFAULT_PLAN]
    sections = plan.sections if plan is not None else chosen(args.sections)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_{device_name(args.device)}" + ("_smoke" if args.smoke else "")
    budget = args.budget if args.budget is not None else (1800 if args.smoke else plan.total_s if plan else 440)

    def write(report: dict) -> None:
        (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / f"{stem}.md").write_text(markdown(report))

    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as work:
        report = run_sections(args.device, args.smoke, Path(work), sections, budget, write, args.budget_scale, plan)
    write(report)
    print(markdown(report), flush=True)
    print(f"wrote {out_dir / stem}.json and .md", flush=True)
