"""Shared benchmark plumbing: machine record, interleaved repeats, medians, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def interleave(variants: dict[str, Callable[[], dict]], repeats: int, desc: str) -> dict[str, list[dict]]:
    """Runs A B C A B C ... `repeats` times; each call returns a dict of measurements."""
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    with tqdm(total=repeats * len(variants), desc=desc, unit="run") as bar:
        for _ in range(repeats):
            for name, fn in variants.items():
                runs[name].append(fn())
                bar.update(1)
    return runs


def summarize(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path
