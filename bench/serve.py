"""The server under load from a standard client: guidellm against `serve run` on the shipped pair.

    python -m bench serve [--concurrency 1 2 4 8 16 32] [--ks 1 2 3 5] [--tokens 128] [--repeats 2]
                          [--method suffix --spec-length 16]  (-> bench/results/serve_<method>.json)
                          [--slo-ttft-ms 1500] [--slo-itl-ms 25]

One replica of serve_config.yaml (autoscaling pinned to 1: the figures compare speculation
settings, not replica counts). For each concurrency level, each repeat runs every mode in turn
(the order rotated per repeat): the mode is applied live through `serve deploy` (user_config:
speculation off, fixed K = k, or the adaptive policy of serve_config.yaml), then one `guidellm
run` keeps that many streaming /v1/completions requests in flight over the held-out code prompts
(greedy, `max_tokens` = --tokens with EOS ignored) until 4 per stream (at least 8) have finished.
Plain and adaptive also run in-process (`bench/in_process.py`: the same load on AsyncLLMEngine with
the replica's engine config and threads), interleaved with the rest: HTTP / in-process is what
the serving layer (proxy, router, SSE, JSON, the client) costs. Reported per level and mode,
medians over repeats: output tokens/s, TTFT and inter-token latency p50/p95, and goodput
(requests/s meeting both SLOs: TTFT and mean inter-token latency). guidellm's JSON for every run
is kept under bench/results/serve_runs/ (not committed: ~15 MB a sweep).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from tqdm import tqdm

from bench import tables
from bench.common import RESULTS, host_class, machine, parser, write
from bench.workloads import load_prompts

REPO = Path(__file__).resolve().parents[1]
RUNS = RESULTS / "serve_runs"
WORKERS_ENV = {"GUIDELLM__MAX_WORKER_PROCESSES": "1"}  # one client process: the 2 cores serve, not load


def modes(ks: list[int], shipped: dict) -> dict[str, dict]:
    """Mode name -> the user_config that applies it (plain, fixed K per k, the shipped adaptive)."""
    out = {"plain": {"use_speculative_decoding": False}}  # alone: the other fields would do nothing, an error
    out.update({f"K={k}": {**shipped, "use_speculative_decoding": True, "spec_policy": "fixed", "spec_length": k,
                          "k_per_request": False}
                for k in ks})
    out["adaptive"] = {**shipped, "use_speculative_decoding": True, "spec_policy": "adaptive"}
    return out


def guidellm_command(url: str, model: str, streams: int, requests: int, data: Path, out: Path,
                     slo: dict[str, float]) -> list[str]:
    """The `guidellm run` invocation for one level (environment: WORKERS_ENV)."""
    backend = f"kind=openai_http,target={url},model={model},request_format=/v1/completions,extras.body.temperature=0"
    metrics = json.dumps({"kind": "generative", "slo": slo})
    return [str(Path(sys.executable).parent / "guidellm"), "run", "--disable-console-interactive",
            "--backend", backend, "--profile", f"kind=concurrent,streams={streams}",
            "--constraint", f"kind=max_requests,count={requests}", "--data", f"kind=json_file,path={data}",
            "--metrics", metrics, "--output", f"kind=json,path={out}", "--seed", "kind=static,value=0"]


def shareable(command: list[str], url: str, data: Path) -> str:
    """A run's command as a person would type it: against `serve run serve_config.yaml` on port
    8000, the prompts in prompts.jsonl ({"prompt", "output_tokens_count"} per line)."""
    shown = " ".join(f"{k}={v}" for k, v in WORKERS_ENV.items()) + " " + " ".join(shlex.quote(a) for a in command)
    for old, new in ((str(Path(sys.executable).parent / "guidellm"), "guidellm"), (url, "http://127.0.0.1:8000"),
                     (str(data), "prompts.jsonl"), (str(RUNS) + "/", "")):
        shown = shown.replace(old, new)
    return shown


def figures(report: dict) -> dict:
    """The figures of one guidellm run (its JSON report, one benchmark)."""
    m = report["benchmarks"][0]["metrics"]

    def pct(name: str, q: str) -> float:
        return m[name]["successful"]["percentiles"][q]
    goodput = m.get("request_goodput")
    return {"tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "ttft_ms": {"p50": pct("time_to_first_token_ms", "p50"), "p95": pct("time_to_first_token_ms", "p95")},
            "itl_ms": {"p50": pct("inter_token_latency_ms", "p50"), "p95": pct("inter_token_latency_ms", "p95")},
            "goodput_rps": goodput["successful"]["mean"] if goodput else None,
            "slo_attainment": m.get("slo_attainment"),
            "requests": m["request_totals"]}


class LiveServer:
    """The running application: its URL, config and `serve deploy` of a new user_config."""

    def __init__(self, server, served_model: str):
        self.server, self.model = server, served_model
        self.client = httpx.Client(base_url=server.url, timeout=120)

    def apply(self, user_config: dict, work: Path) -> None:
        """Deploys `user_config` live and waits (bounded) until the replica reports it."""
        from bench.local_server import ray_env, serve_bin

        cfg = json.loads(json.dumps(self.server.config))
        cfg["applications"][0]["deployments"][0]["user_config"] = user_config
        path = work / "serve_config_mode.yaml"
        path.write_text(yaml.safe_dump(cfg))
        subprocess.run([serve_bin(), "deploy", str(path)], check=True, capture_output=True, timeout=120, env=ray_env())
        deadline = time.monotonic() + 120
        while not self._applied(user_config):
            if time.monotonic() > deadline:
                raise TimeoutError(f"user_config {user_config} did not reach the replica within 120 s")
            time.sleep(0.2)  # polling the replica's reported settings, bounded above

    def _applied(self, user_config: dict) -> bool:
        spec = self.client.get("/v1/engine/stats").json()["speculation"]
        return all(spec.get(k) == v for k, v in user_config.items())


class InProcess:
    """The replica's engine config in this process (same threads), for the in-process variants."""

    def __init__(self, engine_args: dict, threads: int):
        from engine.config import EngineConfig, with_embedded_defaults
        from serve_app.async_engine import AsyncLLMEngine

        self.engine = AsyncLLMEngine(EngineConfig.from_kwargs(**{**with_embedded_defaults(engine_args),
                                                                  "num_threads": threads}))

    def run(self, user_config: dict, prompts: list[str], tokens: int, streams: int, requests: int) -> dict:
        import asyncio

        from bench.in_process import run_load
        from engine.sampling_params import SamplingParams

        asyncio.run(self.engine.call(lambda engine: engine.reconfigure_speculation(**user_config)))
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        return asyncio.run(run_load(self.engine, prompts, params, streams, requests))


IN_PROCESS = ("plain", "adaptive")  # the modes also run in-process


def sweep(live: LiveServer, local: InProcess, args, mode_configs: dict[str, dict], data: Path,
          work: Path) -> tuple[dict, list[str]]:
    """{level: {variant: [figures per repeat]}} (variants: each mode over HTTP, and IN_PROCESS
    modes in-process) and the guidellm command of the last run."""
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_itl_ms}
    prompts = load_prompts("code")
    results: dict = {}
    names = list(mode_configs) + [f"{m} in-process" for m in IN_PROCESS]
    command: list[str] = []
    with tqdm(total=len(args.concurrency) * args.repeats * len(names), desc="serve", unit="run") as bar:
        for level in args.concurrency:
            requests = max(8, 4 * level)
            for rep in range(args.repeats):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    mode = name.removesuffix(" in-process")
                    if name != mode:
                        fig = local.run(mode_configs[mode], prompts, args.tokens, level, requests)
                    else:
                        live.apply(mode_configs[mode], work)
                        out = RUNS / f"c{level}_{name.replace('=', '')}_r{rep}.json"
                        command = guidellm_command(live.server.url, live.model, level, requests, data, out, slo)
                        subprocess.run(command, check=True, env={**os.environ, **WORKERS_ENV}, cwd=work,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        fig = figures(json.loads(out.read_text()))
                    results.setdefault(str(level), {}).setdefault(name, []).append(fig)
                    bar.set_postfix_str(f"c={level} {name}: {fig['tok_s']:.0f} tok/s")
                    bar.update(1)
    return results, command


def medians(runs: list[dict]) -> dict:
    def med(get):
        values = [get(r) for r in runs if get(r) is not None]
        return statistics.median(values) if values else None
    out = {"tok_s": med(lambda r: r["tok_s"]), "tok_s_range": [min(r["tok_s"] for r in runs), max(r["tok_s"] for r in runs)],
           "goodput_rps": med(lambda r: r["goodput_rps"]), "slo_attainment": med(lambda r: r["slo_attainment"])}
    for key in ("ttft_ms", "itl_ms"):
        out[key] = {q: med(lambda r, key=key, q=q: r[key][q]) for q in ("p50", "p95")}
    return out


def table(results: dict) -> dict:
    """Per level: each mode's medians, the best fixed K, and adaptive over max(plain, best fixed K)."""
    out = {}
    for level, by_mode in results.items():
        row = {name: medians(runs) for name, runs in by_mode.items()}
        fixed = {n: r for n, r in row.items() if n.startswith("K=")}  # over HTTP
        best_fixed = max(fixed, key=lambda n: fixed[n]["tok_s"]) if fixed else None
        best = max([row["plain"]["tok_s"]] + ([fixed[best_fixed]["tok_s"]] if fixed else []))
        out[level] = {"modes": row, "best_fixed": best_fixed,
                      "adaptive_over_best": row["adaptive"]["tok_s"] / best,
                      "adaptive_over_plain": row["adaptive"]["tok_s"] / row["plain"]["tok_s"],
                      "http_over_in_process": {m: row[m]["tok_s"] / row[f"{m} in-process"]["tok_s"] for m in IN_PROCESS}}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser("serve", __doc__, tokens=128, models=False)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--ks", type=int, nargs="*", default=[1, 2, 3, 5], help="fixed K values to compare")
    ap.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    ap.add_argument("--slo-itl-ms", type=float, default=25.0, help="SLO on each request's mean inter-token latency")
    ap.add_argument("--config", type=Path, default=REPO / "serve_config.yaml")
    ap.add_argument("--method", help="speculative_method of every speculative mode (default: serve_config.yaml's)")
    ap.add_argument("--spec-length", type=int, help="the adaptive mode's spec_length (default: serve_config.yaml's)")
    ap.set_defaults(repeats=2)
    args = ap.parse_args(argv)
    from bench.local_server import local_server

    cfg = yaml.safe_load(args.config.read_text())
    app, deployment = cfg["applications"][0], cfg["applications"][0]["deployments"][0]
    deployment.pop("autoscaling_config", None)
    deployment["num_replicas"] = 1
    shipped = dict(deployment.get("user_config") or {})
    if args.method:
        shipped["speculative_method"] = args.method
    mode_configs = modes(args.ks, shipped)
    if args.spec_length:
        mode_configs["adaptive"]["spec_length"] = args.spec_length
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "output_tokens_count": args.tokens}) + "\n"
                            for p in load_prompts("code")))
    RUNS.mkdir(parents=True, exist_ok=True)
    threads = math.ceil(deployment["ray_actor_options"].get("num_cpus", 1))  # as serve_app.server sets them
    with local_server(cfg, work) as server:
        url = server.url
        live = LiveServer(server, app["args"].get("served_model_name", "specserve-default"))
        stats = live.client.get("/v1/engine/stats").json()
        local = InProcess(app["args"].get("engine") or {}, threads)
        try:
            results, command = sweep(live, local, args, mode_configs, data, work)
        finally:
            local.engine.shutdown()
    rows = table(results)
    for level, row in rows.items():
        print(f"c={level:>2}: " + "  ".join(f"{n} {m['tok_s']:.0f}" for n, m in row["modes"].items())
              + f"  | adaptive / max(plain, {row['best_fixed']}) {row['adaptive_over_best']:.3f}"
              + f", / plain {row['adaptive_over_plain']:.2f}")
    path = write(f"serve_{args.method}" if args.method else "serve", {"host": host_class(machine()), "tokens": args.tokens, "repeats": args.repeats,
                           "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms}, "modes": mode_configs,
                           "forward_plan": stats.get("forward_plan"), "engine_threads": threads,
                           "guidellm_command": shareable(command, url, data), "results": rows, "raw": results})
    print(f"wrote {path}")


def draw(r: dict) -> list[str]:
    slo = r["slo"]
    lines = [f"**Serving sweep with guidellm** — `serve run serve_config.yaml` (one replica, {r['engine_threads']} "
             f"engine thread), {tables.host(r['machine'])}; per level, each mode applied live (`serve deploy` of its user_config) "
             f"then `guidellm run` with that many concurrent streams, {r['tokens']} output tokens a request over the "
             f"code prompts, greedy; medians of {r['repeats']} interleaved repeats (`python -m bench serve`). "
             f"Goodput: requests/s with TTFT ≤ {slo['ttft_ms']:.0f} ms and mean inter-token latency ≤ "
             f"{slo['itl_ms']:.0f} ms. One run's command, against `serve run serve_config.yaml` on port 8000 "
             "(`prompts.jsonl`: the code prompts, a `{\"prompt\", \"output_tokens_count\"}` object a line):", "", f"`{r['guidellm_command']}`", "",
             "| streams | mode | output tok/s (range) | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | goodput (req/s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for level, row in r["results"].items():
        for name, m in row["modes"].items():
            goodput = "" if m["goodput_rps"] is None else f"{m['goodput_rps']:.2f}"
            lines.append(f"| {level} | {name} | {m['tok_s']:.0f} ({m['tok_s_range'][0]:.0f}–{m['tok_s_range'][1]:.0f}) | "
                         f"{m['ttft_ms']['p50']:.0f} / {m['ttft_ms']['p95']:.0f} | {m['itl_ms']['p50']:.1f} / "
                         f"{m['itl_ms']['p95']:.1f} | {goodput} |")
    lines += ["", "Adaptive ÷ max(plain, best fixed K), output tokens/s: " + ", ".join(
        f"{lv} streams {row['adaptive_over_best']:.3f} ({row['best_fixed']})" for lv, row in r["results"].items()),
        "", "HTTP ÷ in-process (the serving layer's share): " + ", ".join(
        f"{lv} streams " + " / ".join(f"{m} {v:.2f}" for m, v in row["http_over_in_process"].items())
        for lv, row in r["results"].items()), ""]
    return lines + tables.img("serve")



def page_targets(row: tables.Row) -> None:
    """The serving targets: adaptive against the best fixed K, and at one stream against plain."""
    if (r := tables.load("serve")) is not None:
        ratios = {lv: row_["adaptive_over_best"] for lv, row_ in r["results"].items()}
        worst = min(ratios, key=ratios.get)
        row("serving (guidellm): adaptive >= 0.97 x max(plain, best fixed K) at every concurrency",
            f"{min(ratios.values()):.3f} ({worst} streams) to {max(ratios.values()):.3f}", min(ratios.values()) >= 0.97)
        if "1" in r["results"]:
            one = r["results"]["1"]["adaptive_over_plain"]
            row("serving (guidellm): adaptive >= 1.8x plain at concurrency 1", f"{one:.2f}x", one >= 1.8)


if __name__ == "__main__":
    main()
