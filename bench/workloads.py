"""Benchmark workloads: held-out prompts of the shipped pair (never its training files).

- `code`: the first lines of a function or class from validation files (continue the code);
- `edit`: a function from a validation file followed by an instruction-like comment asking to
  rewrite it, so the output repeats much of the prompt (prompt lookup's best case).
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
FILES = {"code": "code_val_prompts.jsonl", "edit": "edit_val_prompts.jsonl"}


def load_prompts(workload: str, n: int | None = None) -> list[str]:
    if workload not in FILES:
        raise ValueError(f"workload must be one of {sorted(FILES)}, got {workload!r}")
    rows = [json.loads(line)["prompt"] for line in (DATA / FILES[workload]).read_text().splitlines()]
    return rows[:n] if n is not None else rows
