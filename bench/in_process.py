"""The load guidellm puts on the server, run in-process against `AsyncLLMEngine` (no Ray, no HTTP):
what guidellm cannot measure, the serving layer's share of the cost (`python -m bench serve`).

`streams` coroutines each send requests back to back until `requests` have finished; figures as
guidellm names them: output tokens/s over the run, TTFT and per-request mean inter-token latency
percentiles.
"""

from __future__ import annotations

import asyncio
import itertools
import time


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


async def _one(engine, prompt: str, params) -> dict:
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async for delta in engine.generate(prompt, params):
        if delta.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += len(delta.token_ids)
    return {"ttft_ms": 1e3 * (first - t0), "itl_ms": 1e3 * (last - first) / (tokens - 1) if tokens > 1 else None,
            "tokens": tokens}


async def run_load(engine, prompts: list[str], params, streams: int, requests: int) -> dict:
    """`streams` concurrent clients over `prompts` (cycled) until `requests` have finished."""
    source = itertools.cycle(prompts)
    budget = iter(range(requests))
    records: list[dict] = []

    async def client():
        for _ in budget:
            records.append(await _one(engine, next(source), params))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    wall = time.perf_counter() - t0
    itl = [r["itl_ms"] for r in records if r["itl_ms"] is not None]
    ttft = [r["ttft_ms"] for r in records]
    return {"tok_s": sum(r["tokens"] for r in records) / wall,
            "ttft_ms": {"p50": percentile(ttft, 0.5), "p95": percentile(ttft, 0.95)},
            "itl_ms": {"p50": percentile(itl, 0.5), "p95": percentile(itl, 0.95)},
            "goodput_rps": None, "slo_attainment": None, "requests": {"successful": len(records)}}
