"""Two Ray nodes on one machine: a head and a worker started with `ray start` on loopback, each
with its own CPU (1), token auth on (serve_app.local_run.ray_env); `serve deploy` of
serve_config.yaml (one engine replica of 1 CPU per node, the proxy on the head), requests
answered by both replicas; then the worker node is killed mid-load (its raylet and every process
under it, SIGKILL: a machine gone): the streams it held end with a clear error (never a hang, never
a cut stream ending in [DONE] without an error), new requests are served by the head's replica,
and the replica comes back when the node rejoins. Both nodes' metrics endpoints carry the
engine's metrics for their own replica, and a real Prometheus scraping both sees them.

The cluster has its own ports (the shared `serve run` of the other tests may be up beside it)
and is torn down by process, never by `ray stop`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from bench.local_server import REPO, free_port, ray_env, serve_bin

RAY = str(Path(sys.executable).parent / "ray")
PROMPT = "def merge_sorted(a, b):\n"
# Serve's proxy (on the head) otherwise sends every request to a replica on its own node while that
# one has room: the worker's replica would only see overflow (docs/deployment/scale-out.md)
NODE_ENV = {"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}
# SPECSERVE_TWO_NODES_TOPOLOGY=ingress runs the same test on serve_config.ingress.yaml (its ingress
# pinned to the head by a custom resource); the suite runs serve_config.yaml only (time budget)
TOPOLOGY = os.environ.get("SPECSERVE_TWO_NODES_TOPOLOGY", "single")
HEAD_RESOURCE = "specserve_head"


def children(pid: int) -> list[int]:
    """Every descendant of pid (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    for p in [pid, *children(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


class Node:
    """One `ray start --block` (its own session: the node's processes are its descendants)."""

    def __init__(self, work: Path, name: str, head_address: str | None, cpus: int):
        self.name = name
        self.ports = {k: free_port() for k in ("node-manager-port", "object-manager-port", "metrics-export-port",
                                               "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                               "runtime-env-agent-port")}
        args = [RAY, "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--num-gpus=0",
                *(f"--{k}={v}" for k, v in self.ports.items())]
        if head_address is None:
            self.gcs_port, self.dashboard_port = free_port(), free_port()
            args += ["--head", f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1",
                     f"--resources={json.dumps({HEAD_RESOURCE: 1})}",
                     f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={free_port()}"]
        else:
            args += [f"--address={head_address}"]
        lo = 20000 + (0 if head_address is None else 1000)
        args += [f"--min-worker-port={lo}", f"--max-worker-port={lo + 999}"]
        self.log = open(work / f"ray_{name}.log", "a")
        self.proc = subprocess.Popen(args, env={**ray_env(), **NODE_ENV}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=REPO)

    def kill(self) -> None:
        """SIGKILL to the node's every process: to the cluster, the machine is gone."""
        kill_tree(self.proc.pid)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(self.proc.pid)
        self.log.close()


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)  # polling the cluster's state, bounded by the deadline
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def serve_cli(*args: str, dashboard: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([serve_bin(), *args, "-a", dashboard], capture_output=True, text=True, timeout=timeout,
                          env=ray_env())


def stream(url: str, body: dict, timeout_s: float = 120) -> dict:
    """One streaming completion: status, text, whether [DONE] came, the error event if any, or the
    transport error (a connection cut is a clean failure too)."""
    out = {"status": None, "text": "", "done": False, "error": None, "finish": None, "node": None}
    try:
        with httpx.Client(timeout=timeout_s) as c, c.stream("POST", url + "/v1/completions",
                                                            json={**body, "stream": True}) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = r.read().decode(errors="replace")[:300]
                return out
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["error"] = chunk["error"]
                    elif chunk["choices"]:
                        out["text"] += chunk["choices"][0]["text"]
                        out["finish"] = chunk["choices"][0]["finish_reason"] or out["finish"]
    except httpx.HTTPError as exc:
        out["error"] = f"transport: {exc!r}"
    return out


def replicas_by_node(url: str, tries: int = 40) -> dict[str, str]:
    """{replica id: node id} from the replicas' /v1/engine/stats (asked until two answer; bounded)."""
    seen: dict[str, str] = {}
    with httpx.Client(timeout=10) as c:
        for _ in range(tries):
            try:
                s = c.get(url + "/v1/engine/stats").json()
                seen[s["replica"]] = s["node_id"]
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if len(set(seen.values())) >= 2:
                break
    return seen


def metric_lines(port: int, name: str) -> list[str]:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return []
    return [line for line in text.splitlines() if line.startswith(name) and 'deployment="LLMServer"' in line]


@pytest.fixture
def cluster(tmp_path):
    nodes: list[Node] = []
    head = Node(tmp_path, "head", None, cpus=1)
    nodes.append(head)
    dashboard = f"http://127.0.0.1:{head.dashboard_port}"
    try:
        wait_until(lambda: httpx.get(dashboard + "/api/version", timeout=2).status_code in (200, 401)
                   if _up(dashboard) else False, 120, "the head's dashboard")
        worker = Node(tmp_path, "worker", f"127.0.0.1:{head.gcs_port}", cpus=1)
        nodes.append(worker)
        yield {"head": head, "worker": worker, "nodes": nodes, "dashboard": dashboard, "work": tmp_path}
    finally:
        try:
            serve_cli("shutdown", "-y", dashboard=dashboard, timeout=60)
        except subprocess.TimeoutExpired:
            pass
        for n in reversed(nodes):
            n.stop()


def prometheus_sees_both_nodes(work: Path, ports: list[int]) -> None:
    """A real Prometheus (Debian's package, as tests/e2e/test_metrics_prometheus.py uses) scraping
    both nodes' metrics endpoints (static targets: Ray's service-discovery file under /tmp/ray is
    shared with any other cluster on this machine) sees the engine's counter from each node."""
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is required (.ci/run installs it)"
    cfg = {"global": {"scrape_interval": "1s"},
           "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    with open(work / "prometheus.log", "w") as log:
        proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'prom-data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        def instances() -> set[str]:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", timeout=5, params={
                    "query": 'sum by (instance) (ray_specserve_generation_tokens_total{deployment="LLMServer"})'})
                return {x["metric"]["instance"] for x in r.json()["data"]["result"]}
            except (httpx.HTTPError, KeyError, ValueError):
                return set()

        wait_until(lambda: len(instances()) == 2, 60, "Prometheus to see the engine's metrics from both nodes")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _up(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
        return True
    except httpx.HTTPError:
        return False


def alive_nodes(dashboard: str) -> int:
    out = subprocess.run([RAY, "list", "nodes", "--address", dashboard, "--format", "json", "--filter", "state=ALIVE"],
                         capture_output=True, text=True, timeout=60, env=ray_env())
    try:
        return len(json.loads(out.stdout))
    except ValueError:
        return 0


def test_two_nodes_serve_and_survive_losing_one(cluster):
    head, worker, dashboard, work = cluster["head"], cluster["worker"], cluster["dashboard"], cluster["work"]
    wait_until(lambda: alive_nodes(dashboard) == 2, 120, "two alive nodes")
    name = "serve_config.yaml" if TOPOLOGY == "single" else "serve_config.ingress.yaml"
    cfg = yaml.safe_load((REPO / name).read_text())
    port = free_port()
    cfg["http_options"].update(host="127.0.0.1", port=port)
    app = cfg["applications"][0]
    app["args"]["engine"]["num_threads"] = 1
    dep = next(d for d in app["deployments"] if d["name"] == "LLMServer")
    for other in app["deployments"]:
        if other["name"] == "OpenAIIngress":  # on the head, beside the proxy
            other["ray_actor_options"] = {"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.01}}
    dep.pop("autoscaling_config", None)
    dep.update(num_replicas=2, ray_actor_options={"num_cpus": 1}, health_check_period_s=2, health_check_timeout_s=10)
    path = work / "serve_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    deployed = serve_cli("deploy", str(path), dashboard=dashboard)
    assert deployed.returncode == 0, deployed.stderr[-2000:]
    url = f"http://127.0.0.1:{port}"

    def two_running() -> bool:
        status = yaml.safe_load(serve_cli("status", dashboard=dashboard).stdout) or {}
        dep_status = (((status.get("applications") or {}).get("specserve") or {}).get("deployments") or {}).get(
            "LLMServer") or {}
        return (dep_status.get("replica_states") or {}).get("RUNNING") == 2

    wait_until(two_running, 300, "two RUNNING replicas (serve status)")
    placement = wait_until(lambda: (lambda s: s if len(set(s.values())) == 2 else None)(replicas_by_node(url)), 60,
                           "both replicas answering, on two nodes")
    assert len(set(placement.values())) == 2, placement
    # both replicas answer requests
    # prompts with nothing in common, so that a prefix-aware router (ingress topology) spreads them too
    starts = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    answers = [stream(url, {"prompt": f"{w} = {PROMPT}", "max_tokens": 8, "temperature": 0}) for w in starts]
    assert all(a["done"] and not a["error"] for a in answers), answers
    served_by = {}
    for _ in range(40):
        s = httpx.get(url + "/v1/engine/stats", timeout=10).json()
        served_by[s["node_id"]] = s["prefix_cache"]["prompt_tokens"]
    assert len(served_by) == 2 and all(v > 0 for v in served_by.values()), served_by
    # both nodes' metrics endpoints export the engine's counters for their replica (what Prometheus scrapes)
    wait_until(lambda: metric_lines(head.ports["metrics-export-port"], "ray_specserve_generation_tokens_total")
               and metric_lines(worker.ports["metrics-export-port"], "ray_specserve_generation_tokens_total"), 60,
               "the engine's metrics on both nodes' metrics endpoints")

    prometheus_sees_both_nodes(work, [head.ports["metrics-export-port"], worker.ports["metrics-export-port"]])

    # --- the worker node dies mid-load ---------------------------------------------------------
    head_id = head_node_id(dashboard)
    worker_node = next(n for n in placement.values() if n != head_id)
    results: list[dict] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        r = stream(url, {"prompt": f"{starts[i % len(starts)]} = {PROMPT}", "max_tokens": 300, "temperature": 0,
                         "ignore_eos": True}, timeout_s=120)
        with lock:
            results.append(r)

    threads: list[threading.Thread] = []

    def worker_busy() -> bool:
        # the router sends this to the less loaded replica, so the worker's may not answer while
        # its requests run: a new wave of 8 long requests whenever the last one has ended
        if not any(t.is_alive() for t in threads):
            for _ in range(8):
                threads.append(threading.Thread(target=client, args=(len(threads),)))
                threads[-1].start()
        s = httpx.get(url + "/v1/engine/stats", timeout=10).json()
        return s["node_id"] == worker_node and s["running"] > 0

    wait_until(worker_busy, 180, "requests in flight on the worker node's replica")
    killed_at = time.monotonic()
    worker.kill()
    after: list[tuple[float, dict]] = []
    first_ok = None
    while time.monotonic() - killed_at < 60 and first_ok is None:  # new requests while the node is gone
        r = stream(url, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}, timeout_s=60)
        after.append((time.monotonic() - killed_at, r))
        if r["done"] and not r["error"]:
            first_ok = time.monotonic() - killed_at
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert len(results) == len(threads)
    # a stream claimed complete ([DONE] without an error event) is whole: its finish reason is there
    assert all(r["finish"] == "length" for r in results if r["done"] and not r["error"]), results
    completed = [r for r in results if r["done"] and not r["error"]]
    failed = [r for r in results if r["error"] or not r["done"]]  # an error event, a status, or a cut connection
    assert failed, "no request was in flight on the killed node"
    assert first_ok is not None, f"no request succeeded within 60 s of the node's death: {after[-3:]}"
    # later requests all go to the surviving replica
    later = [stream(url, {"prompt": f"{PROMPT}# after {i}\n", "max_tokens": 8, "temperature": 0}) for i in range(6)]
    assert all(r["done"] and not r["error"] for r in later), later

    # --- the node rejoins: its replica comes back ------------------------------------------------
    rejoined_at = time.monotonic()
    cluster["nodes"].append(Node(work, "worker2", f"127.0.0.1:{head.gcs_port}", cpus=1))
    wait_until(two_running, 300, "two RUNNING replicas after the node rejoined")
    wait_until(lambda: len(set(replicas_by_node(url).values())) == 2, 120, "a replica on the rejoined node answering")
    back_s = time.monotonic() - rejoined_at
    report = {"topology": TOPOLOGY, "sent": len(results), "completed": len(completed), "failed_clean": len(failed),
              "errors": sorted({str(r["error"])[:160] if r["error"] else "stream cut without [DONE]" for r in failed}),
              "new_requests_failed_before_first_success": sum(1 for _, r in after if r["error"]),
              "first_success_after_kill_s": round(first_ok, 2), "replica_back_after_rejoin_s": round(back_s, 1),
              "down_s": round(time.monotonic() - killed_at, 1)}
    print("\ntwo-node kill:", json.dumps(report))
    if os.environ.get("SPECSERVE_RECORD_TWO_NODES") == "1":  # the figures for docs/deployment/scale-out.md
        (REPO / "bench" / "results" / f"two_nodes_{TOPOLOGY}_last.json").write_text(json.dumps(report, indent=2))


def head_node_id(dashboard: str) -> str:
    out = subprocess.run([RAY, "list", "nodes", "--address", dashboard, "--format", "json"],
                         capture_output=True, text=True, timeout=60, env=ray_env())
    nodes = json.loads(out.stdout)
    return next(n["node_id"] for n in nodes if n.get("is_head_node"))
