"""A census of host-device synchronisations per decode step, by source line: plain and speculative
(a draft model, K = 3), greedy and sampled, batch 1 and 16. On CUDA, torch's sync debug mode reports
every synchronising call (reads back, copies from pageable memory, explicit waits); on CPU, where
nothing synchronises, the engine's own read / upload / wait calls are counted instead, so the smoke
run exercises the same code. Goal: at most 2 a plain step, at most K + 3 a speculative one."""

from __future__ import annotations

import collections
import contextlib
import statistics
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

import engine.host_sync as host_sync
from bench.gpu.context import Context, check
from engine import LLM, SamplingParams
from tests.helpers import make_model, make_tokenizer

K = 3
REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def counting(cuda: bool) -> Iterator[collections.Counter]:
    """Counts synchronising calls by 'file:line' while open."""
    seen: collections.Counter = collections.Counter()
    if cuda:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield seen
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                seen[f"{_short(w.filename)}:{w.lineno}"] += 1
        return
    originals = {name: getattr(host_sync, name) for name in ("read", "upload", "wait")}

    def counted(name):
        def wrapper(*args, **kwargs):
            import inspect
            caller = inspect.stack()[1]
            seen[f"{name} {_short(caller.filename)}:{caller.lineno}"] += 1
            return originals[name](*args, **kwargs)
        return wrapper

    for name in originals:
        setattr(host_sync, name, counted(name))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(host_sync, name, fn)


def _short(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return Path(path).name


def _census(ctx: Context, llm: LLM, batch: int, params: SamplingParams, steps: int) -> dict:
    engine = llm.engine
    ids = [engine.add_request([5 + i, 9, 30, 7, 2 + i] * 3, params) for i in range(batch)]
    while any(not engine.request(r).output_token_ids for r in ids):
        engine.step()
    per_step, by_line = [], collections.Counter()
    for _ in range(steps):
        with counting(ctx.device.startswith("cuda")) as seen:
            engine.step()
        per_step.append(sum(seen.values()))
        by_line.update(seen)
    for r in ids:
        engine.abort(r)
        engine.release(r)
    return {"median": statistics.median(per_step), "max": max(per_step), "per_step": per_step,
            "by_line": {k: v / steps for k, v in by_line.most_common()}}


def run(ctx: Context, out: dict) -> None:
    work = ctx.work / "syncs"
    tok = work / "tok"
    make_tokenizer(tok)
    make_model(work / "target", tok, seed=0)
    make_model(work / "draft", tok, seed=6, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    cuda = ctx.device.startswith("cuda")
    out["counted"] = "torch.cuda sync debug mode" if cuda else "engine read/upload/wait calls (CPU proxy)"
    steps = ctx.size(6, 3)
    rows = out["steps"] = {}
    for spec in (False, True):
        extra = dict(use_speculative_decoding=True, speculative_method="draft", draft_model=str(work / "draft"),
                     spec_length=K, spec_policy="fixed") if spec else {}
        llm = LLM(**ctx.engine_kwargs(16, 256, model=str(work / "target"), dtype="float32", **extra))
        for batch in (1, 16):
            for temperature in (0.0, 0.8):
                params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, max_tokens=120,
                                        ignore_eos=True, seed=3)
                name = f"{'speculative K=3' if spec else 'plain'}, batch {batch}, temperature {temperature}"
                rows[name] = r = _census(ctx, llm, batch, params, steps)
                ctx.log(f"{name}: {r['median']} syncs a step; " + ", ".join(f"{k} x{v:g}" for k, v in r["by_line"].items()))
                if cuda:
                    goal = K + 3 if spec else 2
                    check(out, f"{name}: at most {goal} syncs a step", r["max"] <= goal,
                          {"max": r["max"], "by_line": r["by_line"]})
        del llm
        ctx.free()
    out["summary"] = [f"{name}: median {r['median']} (max {r['max']}) {out['counted']}; top: "
                      + ", ".join(f"{k} x{v:g}" for k, v in list(r["by_line"].items())[:4]) for name, r in rows.items()]
