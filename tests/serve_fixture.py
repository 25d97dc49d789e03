"""A real `serve run` of serve_config.yaml on loopback, shared by the e2e and reliability tests.

The config is the repository's own serve_config.yaml with only the HTTP port changed (a free
port) and an API key set, so the tests exercise exactly what `serve run serve_config.yaml`
deploys. SPECSERVE_E2E_ENGINE (JSON) may override engine fields while developing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
API_KEY = "e2e-secret-key"
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    config_path: Path
    config: dict
    log_path: Path

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, **{"timeout": 120, **kw})

    @property
    def max_seq_len(self) -> int:
        return self.config["applications"][0]["args"]["engine"]["max_seq_len"]

    def stats(self) -> dict:
        with self.client() as c:
            return c.get("/v1/engine/stats").json()

    def wait_until(self, predicate, timeout_s: float, what: str):
        """Polls predicate() until true; fails after timeout_s (a bounded wait, not a sleep)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def ray_env() -> dict:
    """Environment for `serve run/deploy/status`: Ray's token auth on for every client, so the
    CLI can talk to the dashboard of the cluster `serve run` started."""
    return {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}


def serve_bin() -> str:
    return str(Path(sys.executable).parent / "serve")


def ray_stop() -> None:
    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], env=ray_env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    cfg = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    port = free_port()
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    env_vars = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
    env_vars["SPECSERVE_API_KEY"] = API_KEY
    env_vars["SPECSERVE_TEST_HOOKS"] = "1"  # fault injection for the reliability suite
    overrides = os.environ.get("SPECSERVE_E2E_ENGINE")
    if overrides:
        app["args"]["engine"].update(json.loads(overrides))
    config_path = work / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    log_path = work / "serve.log"
    ray_stop()
    env = ray_env()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([serve_bin(), "run", str(config_path)], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", config_path, cfg, log_path)

    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"serve run exited early:\n{log_path.read_text()[-3000:]}")
        if "Failed to update the deployments" in log_path.read_text():
            raise AssertionError(f"the deployment failed:\n{log_path.read_text()[-3000:]}")
        try:
            return httpx.get(srv.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        srv.wait_until(ready, START_TIMEOUT_S, "the application to become healthy")
        yield srv
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        ray_stop()
