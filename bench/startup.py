"""Start-up time, cold (empty caches: kernels built, forward plans and calibration measured) and
warm (the caches the cold start wrote), each in a fresh process:

    python -m bench startup [--tree DIR] [--repeats 3] [--what llm serve]

- llm: `LLM(**serve_config.yaml's engine)` constructed (imports included), and the engine's own
  start-up phases (`LLMEngine.startup`);
- serve: `serve run serve_config.yaml` to the first answered POST /v1/completions.
A cold run gets a fresh SPECSERVE_CACHE; the warm runs after it reuse that one. DIR: another
checkout to time (its own .venv is not needed: this interpreter runs it). Writes
bench/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import tables  # noqa: E402  (after the path: this file also runs as a script)

LLM_SNIPPET = """
import json, sys, time
t0 = time.perf_counter()
from engine import LLM
llm = LLM(**json.loads(sys.argv[1]))
print("STARTUP " + json.dumps({"seconds": time.perf_counter() - t0, "phases": getattr(llm.engine, "startup", None)}))
"""


def engine_config(tree: Path) -> dict:
    app = yaml.safe_load((tree / "serve_config.yaml").read_text())["applications"][0]
    from engine.config import with_embedded_defaults

    return with_embedded_defaults(app["args"]["engine"])


def time_llm(tree: Path, cache: Path) -> dict:
    env = {**os.environ, "SPECSERVE_CACHE": str(cache), "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", LLM_SNIPPET, json.dumps(engine_config(tree))], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("STARTUP ")), None)
    if line is None:
        raise RuntimeError(f"LLM() failed:\n{out.stderr[-3000:]}")
    return json.loads(line[8:])


def time_serve(tree: Path, cache: Path, work: Path) -> dict:
    """Seconds from `serve run` to the first answered completion."""
    from bench.local_server import free_port, ray_env, ray_stop, serve_bin, stop_serve_run

    config = yaml.safe_load((tree / "serve_config.yaml").read_text())
    port = free_port()
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": port}
    path = work / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    ray_stop()
    env = {**ray_env(), "SPECSERVE_CACHE": str(cache), "PYTHONPATH": str(tree)}
    log_path = work / "serve.log"
    body = {"model": "specserve-default", "prompt": "def f(x):\n", "max_tokens": 4, "temperature": 0}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([serve_bin(), "run", str(path)], cwd=tree, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        health = None
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve run exited early:\n{log_path.read_text()[-3000:]}")
            try:
                if health is None and httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    health = time.perf_counter() - t0
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
                if r.status_code == 200:
                    answered = time.perf_counter() - t0
                    return {"first_answer_s": answered, "health_s": health,
                            "calibration_written": _wait_for_calibration(cache)}
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 900:
                raise TimeoutError(f"no answer within 900 s; log: {log_path}")
            time.sleep(0.25)  # polling a child process's readiness, bounded above
    finally:
        stop_serve_run(proc)


def _wait_for_calibration(cache: Path, timeout_s: float = 300) -> bool | None:
    """Waits until the server has written a complete calibration (its idle-time measurement done),
    so the warm start after this one reads everything: True then, False on timeout, None for a
    tree that writes no calibration cache (nothing after 10 s)."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        costs = cache / "costs"
        if costs.exists():
            if any(not json.loads(f.read_text()).get("pending", [1]) for f in costs.glob("*.json")):
                return True
        elif time.perf_counter() - started > 10:
            return None
        time.sleep(0.5)  # polling a file another process writes, bounded above
    return False


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench startup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=str(REPO))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--what", nargs="+", default=["llm", "serve"], choices=["llm", "serve"])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "startup.json"))
    args = ap.parse_args(argv)
    tree = Path(args.tree).resolve()
    from bench.common import machine

    results: dict = {"tree": str(tree), "machine": machine()}
    for what in args.what:
        runs: dict[str, list] = {"cold": [], "warm": []}
        for i in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="startup_") as tmp:
                cache, work = Path(tmp) / "cache", Path(tmp)
                for kind in ("cold", "warm"):
                    r = time_llm(tree, cache) if what == "llm" else time_serve(tree, cache, work)
                    runs[kind].append(r)
                    print(f"{what} {kind} #{i + 1}: {json.dumps(r)}", flush=True)
        key = "seconds" if what == "llm" else "first_answer_s"
        results[what] = {kind: {"summary": summary([r[key] for r in rs]), "runs": rs} for kind, rs in runs.items()}
        print(f"{what}: cold median {results[what]['cold']['summary']['median']:.1f} s, warm median "
              f"{results[what]['warm']['summary']['median']:.1f} s", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


def draw(r: dict) -> list[str]:
    lines = [f"**Start-up** — {r['config']}; each start in a fresh process, cold (empty caches) and warm (the "
             f"caches the cold start wrote), medians of {r['after']['llm']['cold']['summary']['n']}; "
             f"{tables.host(r['machine'])} (`python -m bench startup`):", "",
             "| what | cold (s) | warm (s) |", "| --- | --- | --- |"]
    names = {"llm": "`LLM(...)` constructed", "serve": "`serve run` to the first answered request"}
    for what, name in names.items():
        if what in r["after"]:
            e = r["after"][what]
            lines.append(f"| {name} | {e['cold']['summary']['median']:.1f} | {e['warm']['summary']['median']:.1f} |")
    return lines + [""]



if __name__ == "__main__":
    main()
