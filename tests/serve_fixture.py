"""A real `serve run` of serve_config.yaml on loopback, shared by the e2e and reliability tests.

The config is the repository's own serve_config.yaml with only the HTTP port changed (a free
port) and an API key set, so the tests exercise exactly what `serve run serve_config.yaml`
deploys. SPECSERVE_E2E_ENGINE (JSON) may override engine fields while developing.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from serve_app.local_run import REPO, free_port, local_server, ray_env, serve_bin  # noqa: F401 (re-exported)

API_KEY = "e2e-secret-key"
START_TIMEOUT_S = 300


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


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    cfg = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    app = cfg["applications"][0]
    env_vars = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
    env_vars["SPECSERVE_API_KEY"] = API_KEY
    env_vars["SPECSERVE_TEST_HOOKS"] = "1"  # fault injection for the reliability suite
    overrides = os.environ.get("SPECSERVE_E2E_ENGINE")
    if overrides:
        app["args"]["engine"].update(json.loads(overrides))
    with local_server(cfg, tmp_path_factory.mktemp("serve"), START_TIMEOUT_S) as run:
        yield Server(run.url, run.config_path, run.config, run.log_path)
