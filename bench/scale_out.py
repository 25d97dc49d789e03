"""Scale-out: the two topologies and two routers side by side, over real `serve run`.

    python -m bench scale-out [--repeats 3] [--groups 8] [--conversations 2] [--turns 3] [--tokens 32]
                              [--hop-streams 4] [--hop-requests 16] [--hop-tokens 128]

Part 1, 2 replicas (1 CPU and 1 torch thread each: this host has 2 cores), a shared-prefix
multi-turn chat workload: `--groups` long system prompts (~250 tokens, new ones every repeat so
no run reads an earlier run's cache), each shared by `--conversations` conversations of
`--turns` turns (a short user message, `--tokens` greedy tokens streamed back, the answer kept in
the conversation); conversations start `--stagger` s apart (every group's first conversation,
then every group's second, ...) and run concurrently, each one's turns one after another. Three
variants, each its own `serve run`, the repeats interleaved over them:
  single          serve_config.yaml (one deployment; Serve's proxy routes by queue length)
  ingress         serve_config.ingress.yaml without request_router_config (power of two choices)
  ingress+prefix  serve_config.ingress.yaml as shipped (PrefixCacheAffinityRouter)
Per run: the prefix cache's hit rate (prompt tokens read from the cache / prompt tokens, summed
over both replicas' /v1/engine/stats, before and after), TTFT p50/p95 (to the first content
token, client side), output tok/s (completion tokens / wall time), and the requests each replica
served. Part 2, 1 replica: `single` vs `ingress` on independent code prompts (`--hop-streams`
streams, `--hop-tokens` tokens each, EOS ignored): tok/s and inter-token latency, and their ratio
(the extra hop's cost). Medians over repeats go to bench/results/scale_out.json.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.common import host_class, machine, parser, write
from bench.workloads import load_prompts

REPO = Path(__file__).resolve().parents[1]
WORDS = ("request replica cache token stream model engine prefix router draft target verify accept batch "
         "schedule memory block tensor kernel thread latency budget policy server client metric queue "
         "python function module return value error retry deploy cluster node health proxy").split()


def config(topology: str, replicas: int, router: bool = True, kv_blocks: int | None = None,
           stream_batching_ms: float | None = None) -> dict:
    """serve_config(.ingress).yaml with `replicas` fixed replicas of 1 CPU / 1 thread each;
    `kv_blocks`: each replica's KV pool size in blocks (None: the config's); `stream_batching_ms`
    (ingress only): the engine's stream batching interval (None: the deployment's default)."""
    name = "serve_config.yaml" if topology == "single" else "serve_config.ingress.yaml"
    cfg = yaml.safe_load((REPO / name).read_text())
    app = cfg["applications"][0]
    app["args"]["engine"]["num_threads"] = 1
    if kv_blocks is not None:
        app["args"]["engine"]["num_kv_blocks"] = kv_blocks
    if stream_batching_ms is not None:
        app["args"]["stream_batching_interval_ms"] = stream_batching_ms
    engine = next(d for d in app["deployments"] if d["name"] == "LLMServer")
    engine.pop("autoscaling_config", None)
    engine.update(num_replicas=replicas, ray_actor_options={"num_cpus": 1})
    if not router:
        engine.pop("request_router_config", None)
    return cfg


VARIANTS = {"single": ("single", True), "ingress": ("ingress", False), "ingress+prefix": ("ingress", True)}


def system_prompt(rng: random.Random, group: int) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(180))
    return f"You are assistant {group} of a team. Follow these project notes closely: {words}."


async def chat_turn(client: httpx.AsyncClient, messages: list[dict], tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, last, text, usage = time.perf_counter(), None, None, [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                piece = c["delta"].get("content") or ""
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    n = usage["completion_tokens"] if usage else 0
    return {"ttft_s": (first or time.perf_counter()) - start, "tokens": n, "text": "".join(text),
            "itl_s": (last - first) / (n - 1) if first and n > 1 else None}


async def conversation(client, system: str, turns: int, tokens: int, tag: str, out: list,
                       delay_s: float = 0.0) -> None:
    await asyncio.sleep(delay_s)
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Turn {t} of {tag}: what should the next step be?"})
        res = await chat_turn(client, messages, tokens)
        out.append(res)
        messages.append({"role": "assistant", "content": res["text"]})


def replica_stats(url: str, replicas: int) -> dict[str, dict]:
    """Every replica's /v1/engine/stats (asked until each replica has answered; bounded)."""
    seen: dict[str, dict] = {}
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(200):
            s = c.get("/v1/engine/stats").json()
            seen[s["replica"]] = s
            if len(seen) >= replicas:
                break
    if len(seen) < replicas:
        raise RuntimeError(f"only {len(seen)} of {replicas} replicas answered /v1/engine/stats")
    return seen


def prefix_totals(stats: dict[str, dict]) -> dict[str, tuple[int, int]]:
    return {rid: (s["prefix_cache"]["prompt_tokens"], s["prefix_cache"]["cached_tokens"]) for rid, s in stats.items()}


def shared_prefix_run(url: str, replicas: int, args, repeat: int) -> dict:
    rng = random.Random(1000 + repeat)
    systems = [system_prompt(rng, g) for g in range(args.groups)]
    before = prefix_totals(replica_stats(url, replicas))
    results: list[dict] = []

    async def main():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            await asyncio.gather(*(conversation(client, systems[g], args.turns, args.tokens, f"g{g}c{c}r{repeat}",
                                                results, (c * args.groups + g) * args.stagger)
                                   for c in range(args.conversations) for g in range(args.groups)))

    start = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - start
    after = prefix_totals(replica_stats(url, replicas))
    per_replica = {rid: (after[rid][0] - before.get(rid, (0, 0))[0], after[rid][1] - before.get(rid, (0, 0))[1])
                   for rid in after}
    prompt = sum(p for p, _ in per_replica.values())
    cached = sum(c for _, c in per_replica.values())
    ttft = sorted(r["ttft_s"] * 1000 for r in results)
    return {"hit_rate": cached / prompt if prompt else None, "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_ms": {"p50": statistics.median(ttft), "p95": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))]},
            "tok_s": sum(r["tokens"] for r in results) / wall, "requests": len(results), "wall_s": wall,
            "prompt_tokens_by_replica": {rid: p for rid, (p, _) in per_replica.items()}}


def hop_run(url: str, args) -> dict:
    prompts = load_prompts("code")
    results: list[dict] = []

    async def one(client, prompt):
        body = {"prompt": prompt, "max_tokens": args.hop_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        start, first, last, usage = time.perf_counter(), None, None, None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("text") for c in chunk["choices"]):
                    last = time.perf_counter()
                    first = first or last
        n = usage["completion_tokens"]
        results.append({"ttft_s": first - start, "tokens": n, "itl_s": (last - first) / max(1, n - 1)})

    async def main():
        queue = list(range(args.hop_requests))
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            async def worker():
                while queue:
                    i = queue.pop()
                    await one(client, prompts[i % len(prompts)])
            await asyncio.gather(*(worker() for _ in range(args.hop_streams)))

    start = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - start
    return {"tok_s": sum(r["tokens"] for r in results) / wall,
            "itl_ms_p50": statistics.median(r["itl_s"] * 1000 for r in results),
            "ttft_ms_p50": statistics.median(r["ttft_s"] * 1000 for r in results)}


def med(runs: list[dict], get) -> float | None:
    values = [get(r) for r in runs if get(r) is not None]
    return statistics.median(values) if values else None


def _parser():
    ap = parser("scale-out", __doc__, tokens=32, models=False)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=2, help="conversations per system prompt")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--stagger", type=float, default=0.5,
                    help="seconds between conversation starts (each group's first conversations first)")
    ap.add_argument("--hop-streams", type=int, default=4)
    ap.add_argument("--hop-requests", type=int, default=16)
    ap.add_argument("--hop-tokens", type=int, default=128)
    ap.add_argument("--skip-hop", action="store_true")
    ap.add_argument("--name", default="scale_out", help="bench/results/<name>.json")
    ap.add_argument("--skip-shared", action="store_true", help="only the 1-replica hop comparison")
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="each replica's KV pool in blocks of 16 tokens (default: the config's); smaller than "
                         "all groups' prompts puts the prefix cache under pressure")
    ap.add_argument("--stream-batching-ms", type=float, nargs="+", default=[0.0, 20.0],
                    help="the engine deployment's stream batching intervals the hop part compares")
    return ap


def _rotated(names: list[str], rep: int) -> list[str]:
    """The variants in repeat rep's order: started one further along every repeat."""
    return names[rep % len(names):] + names[:rep % len(names)]


def shared_prefix_part(args, work: Path) -> dict[str, list[dict]]:
    """Part 1: every variant's shared-prefix runs on 2 replicas, a fresh `serve run` each."""
    from bench.local_server import local_server

    raw: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    # one server per variant, kept for all its repeats would hold 3 clusters at once: instead each
    # repeat starts the variants in turn (rotated), a fresh `serve run` each
    for rep in range(0 if args.skip_shared else args.repeats):
        for name in _rotated(list(VARIANTS), rep):
            topology, router = VARIANTS[name]
            with local_server(config(topology, 2, router, args.kv_blocks), work / f"{name}_{rep}") as server:
                replica_stats(server.url, 2)  # both replicas up
                hop_run(server.url, argparse_warm(args))  # warm-up: first batches on each replica
                fig = shared_prefix_run(server.url, 2, args, rep)
            raw[name].append(fig)
            print(f"r{rep} {name:15s} hit {fig['hit_rate']:.3f}  ttft p50 {fig['ttft_ms']['p50']:.0f} ms  "
                  f"p95 {fig['ttft_ms']['p95']:.0f} ms  {fig['tok_s']:.1f} tok/s  by replica "
                  f"{sorted(fig['prompt_tokens_by_replica'].values())}", flush=True)
    return raw


def shared_prefix_table(raw: dict[str, list[dict]]) -> tuple[dict, dict]:
    """Part 1's medians over repeats per variant, and the prefix router's ratios to the others."""
    table = {name: {"hit_rate": med(runs, lambda r: r["hit_rate"]),
                    "ttft_ms_p50": med(runs, lambda r: r["ttft_ms"]["p50"]),
                    "ttft_ms_p95": med(runs, lambda r: r["ttft_ms"]["p95"]),
                    "tok_s": med(runs, lambda r: r["tok_s"])} for name, runs in raw.items()}
    prefix, default = table["ingress+prefix"], table["ingress"]
    ratios = {"hit_rate_prefix_over_default": prefix["hit_rate"] / default["hit_rate"]
              if default["hit_rate"] else None,
              "hit_rate_prefix_over_single": prefix["hit_rate"] / table["single"]["hit_rate"]
              if table["single"]["hit_rate"] else None,
              "ttft_p50_prefix_over_default": prefix["ttft_ms_p50"] / default["ttft_ms_p50"]}
    return table, ratios


def hop_part(args, work: Path) -> dict:
    """Part 2, 1 replica: `single` and `ingress` at each stream batching interval, medians over
    repeats, each ingress variant ÷ single, and the raw runs."""
    from bench.local_server import local_server

    hop_variants = {"single": ("single", None)} | {f"ingress_{ms:g}ms": ("ingress", ms)
                                                    for ms in args.stream_batching_ms}
    hop_raw: dict[str, list[dict]] = {name: [] for name in hop_variants}
    for rep in range(args.repeats):
        for name in _rotated(list(hop_variants), rep):
            topology, ms = hop_variants[name]
            with local_server(config(topology, 1, stream_batching_ms=ms), work / f"hop_{name}_{rep}") as server:
                hop_run(server.url, argparse_warm(args))  # warm-up: plan and calibration caches, first batches
                hop_raw[name].append(hop_run(server.url, args))
            print(f"hop r{rep} {name}: {hop_raw[name][-1]}", flush=True)
    hop = {name: {k: med(runs, lambda r, k=k: r[k]) for k in ("tok_s", "itl_ms_p50", "ttft_ms_p50")}
           for name, runs in hop_raw.items()}
    for name in hop_variants:
        if name != "single":
            hop[f"{name}_over_single"] = {
                "tok_s": hop[name]["tok_s"] / hop["single"]["tok_s"],
                "itl_ms_p50": hop[name]["itl_ms_p50"] / hop["single"]["itl_ms_p50"],
                "tok_s_paired": [i["tok_s"] / s["tok_s"] for i, s in zip(hop_raw[name], hop_raw["single"])]}
    hop["raw"] = hop_raw
    return hop


def print_summary(table: dict, ratios: dict, hop: dict) -> None:
    """Part 1's medians and ratios, then part 2's ratios."""
    for name, row in table.items():
        print(f"{name:15s} hit {row['hit_rate']:.3f}  ttft p50 {row['ttft_ms_p50']:.0f} ms  p95 "
              f"{row['ttft_ms_p95']:.0f} ms  {row['tok_s']:.1f} tok/s")
    if ratios:
        print(json.dumps(ratios))
    for name, row in hop.items():
        if name.endswith("_over_single"):
            print(f"1 replica, {name}:", json.dumps(row))


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-scale-out-"))
    raw = shared_prefix_part(args, work)
    table, ratios = ({}, {}) if args.skip_shared else shared_prefix_table(raw)
    hop = {} if args.skip_hop else hop_part(args, work)
    print_summary(table, ratios, hop)
    path = write(args.name, {"host": host_class(machine()), "replica_cpus": 1, "engine_threads": 1,
                               "workload": {k: getattr(args, k) for k in ("groups", "conversations", "turns", "tokens",
                                                                           "stagger", "repeats", "kv_blocks")},
                               "hop_workload": {k: getattr(args, k) for k in ("hop_streams", "hop_requests",
                                                                               "hop_tokens")},
                               "shared_prefix_2_replicas": table, "ratios": ratios, "hop_1_replica": hop,
                               "raw": raw})
    print(f"wrote {path}")


def argparse_warm(args):
    warm = copy.copy(args)
    warm.hop_requests = args.hop_streams
    warm.hop_tokens = 16
    return warm


if __name__ == "__main__":
    main()
