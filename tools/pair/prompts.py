"""Validation-set code prompts: the first lines of functions and classes from held-out files."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

_DEF = re.compile(r"^(\s*)(def|class|async def) \w+")


def extract_prompts(val_jsonl: Path, n: int, seed: int = 0, lines: int = 3) -> list[dict]:
    """Up to n prompts: a def/class line plus the next `lines - 1` non-empty lines, each from a
    different validation file, chosen with a fixed seed."""
    candidates = []
    with open(val_jsonl) as fh:
        for row in map(json.loads, fh):
            src = row["text"].splitlines()
            starts = [i for i, line in enumerate(src) if _DEF.match(line) and len(src) > i + lines + 8]
            if starts:
                candidates.append((row, src, starts))
    rng = random.Random(seed)
    rng.shuffle(candidates)
    out = []
    for row, src, starts in candidates[:n]:
        i = rng.choice(starts)
        body = [src[i]]
        j = i + 1
        while len(body) < lines and j < len(src):
            if src[j].strip():
                body.append(src[j])
            j += 1
        indent = len(src[i]) - len(src[i].lstrip())
        prompt = "\n".join(line[indent:] for line in body) + "\n"
        out.append({"origin": row["origin"], "path": row["path"], "line": i + 1, "prompt": prompt})
    return out


def write_prompts(val_jsonl: Path, out: Path, n: int = 48) -> list[dict]:
    prompts = extract_prompts(val_jsonl, n)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return prompts


def extract_edit_prompts(val_jsonl: Path, n: int, seed: int = 1, max_lines: int = 24) -> list[dict]:
    """An edit/refactor workload: a whole function, then a comment asking for a renamed copy
    and the copy's first line. A good completion repeats most of the prompt (n-gram friendly)."""
    out = []
    rng = random.Random(seed)
    rows = [json.loads(line) for line in open(val_jsonl)]
    rng.shuffle(rows)
    for row in rows:
        src = row["text"].splitlines()
        for i, line in enumerate(src):
            m = re.match(r"^def (\w+)\(", line)
            if not m:
                continue
            body = [line]
            for nxt in src[i + 1:i + max_lines]:
                if nxt and not nxt.startswith((" ", "\t")):
                    break
                body.append(nxt)
            if len(body) < 6:
                continue
            name = m.group(1)
            func = "\n".join(body).rstrip() + "\n"
            prompt = (func + f"\n\n# Refactor: the same function renamed to {name}_v2, body unchanged.\n"
                      + line.replace(f"def {name}(", f"def {name}_v2(", 1) + "\n")
            out.append({"origin": row["origin"], "path": row["path"], "line": i + 1, "prompt": prompt})
            break
        if len(out) >= n:
            break
    return out


def write_all(val_jsonl: Path, data_dir: Path) -> list[dict]:
    """Writes the code and edit workloads; returns the code prompts."""
    code = write_prompts(val_jsonl, data_dir / "code_val_prompts.jsonl")
    edit = extract_edit_prompts(val_jsonl, 24)
    (data_dir / "edit_val_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in edit))
    return code
