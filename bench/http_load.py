"""End to end through HTTP: `serve run serve_config.yaml` on loopback, N concurrent streaming clients.

    python -m bench http [--clients 1 4 16] [--requests 4] [--tokens 64]

For each N, four bounded phases alternate speculation off / on / off / on (off = the same server
with `spec_length: 0` on every request, i.e. plain decode). Each client sends `requests`
streaming completions back to back (held-out code prompts, greedy, EOS ignored). Reported per
mode: TTFT p50/p99, inter-chunk latency p50/p99, time per output token (TPOT: (last chunk -
first chunk) / (tokens - 1), per request) p50/p99, and throughput (tokens / phase wall time).

The same phases then run in-process against `AsyncLLMEngine` with the replica's engine config
(same threads), so `http / in-process` is the serving layer's cost (proxy, router, SSE, JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import write
from bench.workloads import load_prompts

REPO = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def summarize_phase(records: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in records]
    gaps = [g for r in records for g in r["gaps"]]
    tpot = [r["tpot"] for r in records if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in records)
    ms = 1e3
    return {"requests": len(records), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_ms": {"p50": pct(ttft, 0.5) * ms, "p99": pct(ttft, 0.99) * ms},
            "itl_ms": {"p50": pct(gaps, 0.5) * ms, "p99": pct(gaps, 0.99) * ms},
            "tpot_ms": {"p50": pct(tpot, 0.5) * ms, "p99": pct(tpot, 0.99) * ms}}


def _record(t0: float, chunk_times: list[float], tokens: int) -> dict:
    first = chunk_times[0] if chunk_times else time.perf_counter()
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    tpot = (chunk_times[-1] - first) / (tokens - 1) if tokens > 1 and chunk_times else None
    return {"ttft": first - t0, "gaps": gaps, "tpot": tpot, "tokens": tokens}


async def http_client(client, prompts: list[str], body: dict) -> list[dict]:
    out = []
    for prompt in prompts:
        t0 = time.perf_counter()
        chunk_times, tokens = [], 0
        payload = {**body, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=payload) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0].get("text"):
                    chunk_times.append(time.perf_counter())
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        out.append(_record(t0, chunk_times, tokens))
    return out


async def engine_client(engine, prompts: list[str], params) -> list[dict]:
    out = []
    for prompt in prompts:
        t0 = time.perf_counter()
        chunk_times, tokens = [], 0
        async for delta in engine.generate(prompt, params):
            if delta.token_ids:
                chunk_times.append(time.perf_counter())
                tokens += len(delta.token_ids)
        out.append(_record(t0, chunk_times, tokens))
    return out


def client_prompts(pool: list[str], client: int, requests: int) -> list[str]:
    return [pool[(client * requests + j) % len(pool)] for j in range(requests)]


async def run_phase(make_client, clients: int, requests: int, pool: list[str]) -> dict:
    t0 = time.perf_counter()
    per_client = await asyncio.gather(*(make_client(client_prompts(pool, i, requests)) for i in range(clients)))
    return summarize_phase([r for rs in per_client for r in rs], time.perf_counter() - t0)


async def http_phases(url: str, args, pool: list[str]) -> dict:
    import httpx

    base = {"max_tokens": args.tokens, "temperature": 0.0, "ignore_eos": True}
    results: dict = {}
    limits = httpx.Limits(max_connections=max(args.clients) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await run_phase(lambda ps: http_client(client, ps, base), 1, 2, pool)  # warm-up
        for n in args.clients:
            for mode in ("off", "on", "off", "on"):
                body = {**base, "spec_length": 0} if mode == "off" else base
                res = await run_phase(lambda ps, body=body: http_client(client, ps, body), n, args.requests, pool)
                results.setdefault(str(n), {}).setdefault(mode, []).append(res)
                print(f"http      N={n:3d} spec {mode:3s}: {res['tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{res['ttft_ms']['p50']:6.0f} ms  TPOT p50 {res['tpot_ms']['p50']:5.1f} ms")
    return results


async def engine_phases(engine_cfg: dict, args, pool: list[str]) -> dict:
    from engine.config import EngineConfig, SamplingParams, with_embedded_defaults
    from serve_app.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineConfig.from_kwargs(**with_embedded_defaults(engine_cfg)))  # as the server
    results: dict = {}
    try:
        on = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        off = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, spec_length=0)
        await run_phase(lambda ps: engine_client(engine, ps, on), 1, 2, pool)  # warm-up
        for n in args.clients:
            for mode in ("off", "on", "off", "on"):
                params = off if mode == "off" else on
                res = await run_phase(lambda ps, p=params: engine_client(engine, ps, p), n, args.requests, pool)
                results.setdefault(str(n), {}).setdefault(mode, []).append(res)
                print(f"in-proc   N={n:3d} spec {mode:3s}: {res['tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{res['ttft_ms']['p50']:6.0f} ms  TPOT p50 {res['tpot_ms']['p50']:5.1f} ms")
    finally:
        engine.shutdown()
    return results


def median_of(phases: list[dict]) -> dict:
    """Median over repeated phases of every figure."""
    def med(get):
        return statistics.median(get(p) for p in phases)
    out = {"tok_s": med(lambda p: p["tok_s"]), "requests": sum(p["requests"] for p in phases)}
    for key in ("ttft_ms", "itl_ms", "tpot_ms"):
        out[key] = {q: med(lambda p, key=key, q=q: p[key][q]) for q in ("p50", "p99")}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=4, help="requests per client per phase")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--config", type=Path, default=REPO / "serve_config.yaml")
    args = ap.parse_args(argv)
    from serve_app.local_run import local_server

    pool = load_prompts("code")
    cfg = yaml.safe_load(args.config.read_text())
    app = cfg["applications"][0]
    deployment = app["deployments"][0]
    # one replica throughout: the comparison is serving layer vs engine, not autoscaling
    deployment.pop("autoscaling_config", None)
    deployment["num_replicas"] = 1
    with local_server(cfg, Path(tempfile.mkdtemp(prefix="bench-http-"))) as server:
        http = asyncio.run(http_phases(server.url, args, pool))
    engine_cfg = dict(app["args"]["engine"])
    # a replica runs ceil(num_cpus) torch threads (serve_app.server); the in-process run matches it
    engine_cfg.setdefault("num_threads", math.ceil(deployment["ray_actor_options"].get("num_cpus", 1)))
    inproc = asyncio.run(engine_phases(engine_cfg, args, pool))
    table = {}
    for n in map(str, args.clients):
        row = {}
        for mode in ("off", "on"):
            h, e = median_of(http[n][mode]), median_of(inproc[n][mode])
            row[mode] = {"http": h, "in_process": e, "http_over_in_process": h["tok_s"] / e["tok_s"]}
        row["spec_speedup_http"] = row["on"]["http"]["tok_s"] / row["off"]["http"]["tok_s"]
        row["spec_speedup_in_process"] = row["on"]["in_process"]["tok_s"] / row["off"]["in_process"]["tok_s"]
        table[n] = row
        print(f"N={n}: speculation on/off {row['spec_speedup_http']:.2f}x over HTTP, "
              f"{row['spec_speedup_in_process']:.2f}x in-process; HTTP/in-process throughput "
              f"off {row['off']['http_over_in_process']:.2f}, on {row['on']['http_over_in_process']:.2f}")
    path = write("http_load", {"tokens": args.tokens, "requests_per_client": args.requests,
                               "engine": engine_cfg, "results": table, "raw": {"http": http, "in_process": inproc}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
