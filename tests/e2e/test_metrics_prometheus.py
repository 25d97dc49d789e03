"""A real Prometheus scrapes the running app; every dashboard and alert expression is evaluated.

Prometheus (Debian's package; .ci/run installs it) runs on loopback with the repository's
scrape configuration (Ray's service-discovery file) at a 1 s interval and the repository's
alert rules. Tolerance for the acceptance-rate check: 1e-9 — Prometheus counts the very
events the per-request stats count, so after the counters settle the two must agree exactly
(up to float formatting).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import httpx
import pytest
import yaml

from engine.metrics import METRICS
from tests.serve_fixture import REPO, free_port

DASHBOARD = REPO / "dashboards" / "specserve-grafana.json"
ALERTS = REPO / "dashboards" / "alerts.yml"
RAY_BUILTIN = {"ray_serve_deployment_replica_healthy"}
COMPARISON = re.compile(r"^\((?P<lhs>.*)\)\s*(<|>|<=|>=|==|!=)\s*[0-9.]+$", re.S)


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is required (.ci/run installs it)"
    work = tmp_path_factory.mktemp("prom")
    cfg = yaml.safe_load((REPO / "dashboards" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = "1s"
    cfg["global"]["evaluation_interval"] = "1s"
    cfg["scrape_configs"][0]["file_sd_configs"][0]["refresh_interval"] = "1s"
    cfg["rule_files"] = [str(ALERTS)]
    (work / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.poll() is None, (work / "prometheus.log").read_text()[-2000:]
        try:
            return httpx.get(url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        server.wait_until(ready, 60, "prometheus to start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def query(prom: str, expr: str) -> list:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def scalar(prom: str, expr: str) -> float | None:
    result = query(prom, expr)
    return float(result[0]["value"][1]) if result else None


def dashboard_expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def alert_expressions() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def concrete(expr: str) -> str:
    return expr.replace("$model", ".*").replace("$replica", ".*").replace("$__rate_interval", "1m")


def test_dashboard_and_alerts_use_only_known_metrics():
    known = {"ray_" + m.name for m in METRICS} | RAY_BUILTIN
    for expr in dashboard_expressions() + alert_expressions():
        for name in re.findall(r"\bray_[a-z_]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in known or base in known, f"{name} in {expr!r} is not a defined metric"
    # the documentation's metrics table is generated from METRICS (tests/docs checks every entry)
    from dashboards.build import build

    assert json.loads(DASHBOARD.read_text()) == build(), "run `python dashboards/build.py`"


def test_promtool_accepts_config_and_rules():
    promtool = shutil.which("promtool")
    assert promtool
    subprocess.run([promtool, "check", "config", str(REPO / "dashboards" / "prometheus.yml")], check=True,
                   capture_output=True)
    subprocess.run([promtool, "check", "rules", str(ALERTS)], check=True, capture_output=True)


def test_prometheus_sees_speculation_and_every_expression_returns_data(server, prometheus):
    """One replica's exported counters and Prometheus's series for that replica agree before and
    after this test's traffic (an earlier test's load may have scaled the app up: the test waits
    for one replica, and compares that replica's series only)."""
    from tests.e2e.test_serve_ops import replica_states, serve_status

    server.wait_until(lambda: replica_states(serve_status()) == {"RUNNING": 1}, 240, "one running replica")
    replica = server.stats()["replica"]

    counters = ("specserve_draft_tokens_total", "specserve_draft_accepted_tokens_total",
                "specserve_prefix_cache_hit_tokens_total")

    def exported():
        totals = server.stats()["exported_counter_totals"]
        return tuple(totals.get(name, 0.0) for name in counters)

    def prom_totals():
        return tuple(scalar(prometheus, f'sum(ray_{name}{{replica="{replica}"}})') or 0.0 for name in counters)

    before, cached_before = exported(), server.stats()["prefix_cache"]["cached_tokens"]
    server.wait_until(lambda: prom_totals() == before, 120, "prometheus to scrape the current counters")
    drafted = accepted = 0
    shared = "".join(f"def step_{i}(state):\n    return state + {i}\n\n" for i in range(8))  # several KV blocks
    with server.client() as c:
        for i, prompt in enumerate(["def parse(text):\n", "class Queue:\n", shared + "def load(path):\n"] * 2):
            body = {"prompt": prompt, "max_tokens": 64, "temperature": 0.0 if i % 2 else 0.7, "seed": i,
                    "stream": True, "stream_options": {"include_usage": True}}
            with c.stream("POST", "/v1/completions", json=body) as r:
                last = [json.loads(line[6:]) for line in r.iter_lines()
                        if line.startswith("data: {")][-1]
            drafted += last["speculation"]["draft_tokens"]
            accepted += last["speculation"]["accepted_tokens"]
    assert drafted > 0 and accepted > 0
    hits = server.stats()["prefix_cache"]["cached_tokens"] - cached_before
    assert hits > 0  # the shared prompt's second send read its blocks from the prefix cache
    expected = (before[0] + drafted, before[1] + accepted, before[2] + hits)
    server.wait_until(lambda: prom_totals() == expected, 120, "prometheus to see this test's traffic")
    prom_rate = (prom_totals()[1] - before[1]) / (prom_totals()[0] - before[0])
    assert abs(prom_rate - accepted / drafted) < 1e-9
    # every dashboard expression parses and returns data
    # (a series born during this test needs a second scrape before rate() sees it)
    for expr in dashboard_expressions():
        server.wait_until(lambda e=expr: query(prometheus, concrete(e)), 30, f"data for {expr!r}")
    # alert expressions parse; their measured side returns data
    for expr in alert_expressions():
        query(prometheus, expr)
        m = COMPARISON.match(expr.strip()) or re.match(r"^(?P<lhs>.*?)\s*(<|>)\s*[0-9.]+$", expr.strip(), re.S)
        assert m, expr
        server.wait_until(lambda e=m.group("lhs"): query(prometheus, e), 30, f"data for alert expression {expr!r}")
    rules = httpx.get(prometheus + "/api/v1/rules").json()["data"]["groups"]
    assert {r["name"] for g in rules for r in g["rules"]} == {
        "SpeculationAcceptanceCollapse", "SpeculationFallbackStuckOn", "TimeToFirstTokenHigh", "EngineReplicaDown"}
    assert all(r["health"] == "ok" for g in rules for r in g["rules"])
