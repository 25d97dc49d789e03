"""Draws the Grafana dashboard's panels from a running Prometheus, without Grafana: every panel of
dashboards/build.py, its queries evaluated over the last minutes, in the dashboard's 2-column grid.

    python -m dashboards.render --prometheus http://127.0.0.1:9090 --minutes 15 --out dashboard.png
    python -m dashboards.render --record --out docs/deployment/dashboard.png   # ~7 minutes on 2 cores

--record makes the documentation's picture from a real run: `serve run serve_config.yaml` on a free
loopback port, Prometheus (127.0.0.1:9090) with dashboards/prometheus.yml, and the benchmark's client
(guidellm, as `python -m bench serve` runs it) at 1, 4, 16 and 32 concurrent streams of 128-token
greedy completions of the code prompts; then every panel over the run.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from datetime import datetime

import httpx

from dashboards.build import PANELS

UNITS = {"percentunit": ("%", 100.0), "s": ("ms", 1000.0), "short": ("", 1.0)}


def concrete(expr: str, rate_interval: str) -> str:
    """A panel's query with the dashboard's variables filled in: every model and replica."""
    return expr.replace("$model", ".*").replace("$replica", ".*").replace("$__rate_interval", rate_interval)


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    r = httpx.get(f"{prometheus}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step},
                  timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]


def legend(template: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def render(prometheus: str, start: float, end: float, out: str, rate_interval: str = "30s", step: float = 5.0) -> int:
    """Draws every panel; returns how many series had data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    rows = math.ceil(len(PANELS) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(14, 2.6 * rows), squeeze=False)
    drawn = 0
    for ax, (title, unit, targets, _desc) in zip(axes.flat, PANELS):
        suffix, scale = UNITS.get(unit, ("", 1.0))
        for expr, template in targets:
            for series in query_range(prometheus, concrete(expr, rate_interval), start, end, step):
                points = [(datetime.fromtimestamp(float(t)), float(v) * scale) for t, v in series["values"]
                          if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    ax.plot(*zip(*points), label=legend(template, series["metric"]), linewidth=1.2)
                    drawn += 1
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel(suffix, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left", ncol=3)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="grey")
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    fig.suptitle("specserve — speculative decoding (dashboards/specserve-grafana.json)", fontsize=12)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    return drawn


LEVELS = ((1, 60), (4, 160), (16, 400), (32, 640))  # (concurrent streams, requests)


def record(out: str) -> int:
    """The run described in the module docstring; returns the series drawn."""
    import json
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    import yaml

    from bench.local_server import REPO, local_server
    from bench.serve import WORKERS_ENV, guidellm_command
    from bench.workloads import load_prompts

    work = Path(tempfile.mkdtemp(prefix="dashboard-"))
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "output_tokens_count": 128}) + "\n"
                            for p in load_prompts("code") * 60))
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    with local_server(config, work / "serve") as server, open(work / "prometheus.log", "w") as log:
        prom = subprocess.Popen(["prometheus", f"--config.file={REPO / 'dashboards' / 'prometheus.yml'}",
                                 "--web.listen-address=127.0.0.1:9090", f"--storage.tsdb.path={work / 'tsdb'}"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            start = time.time()
            time.sleep(15)  # a few scrapes of the idle server first
            for streams, requests in LEVELS:
                cmd = guidellm_command(server.url, config["applications"][0]["args"]["served_model_name"], streams,
                                       requests, data, work / f"c{streams}.json", {"ttft_ms": 1500.0, "tpot_ms": 25.0})
                subprocess.run(cmd, env={**os.environ, **WORKERS_ENV}, check=True, capture_output=True, timeout=600)
                print(f"{streams} streams done", flush=True)
            time.sleep(15)
            return render("http://127.0.0.1:9090", start, time.time(), out)
        finally:
            prom.terminate()
            prom.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dashboards.render", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--minutes", type=float, default=15.0, help="the window drawn, ending now (or at --end)")
    ap.add_argument("--end", type=float, help="the window's end, a Unix time (default: now)")
    ap.add_argument("--rate-interval", default="30s", help="what Grafana's $__rate_interval becomes")
    ap.add_argument("--out", default="dashboard.png")
    ap.add_argument("--record", action="store_true", help="run the server under load first (see above)")
    args = ap.parse_args(argv)
    if args.record:
        print(f"wrote {args.out}: {record(args.out)} series")
        return
    end = args.end or time.time()
    drawn = render(args.prometheus, end - 60 * args.minutes, end, args.out, args.rate_interval)
    print(f"wrote {args.out}: {drawn} series")


if __name__ == "__main__":
    main()
