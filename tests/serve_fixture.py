"""A real `serve run` of serve_config.yaml on loopback, shared by the e2e and reliability tests.

The config is the repository's own serve_config.yaml with only the HTTP port changed (a free
port) and an API key set, so the tests exercise exactly what `serve run serve_config.yaml`
deploys. SPECSERVE_E2E_ENGINE (JSON) may override engine fields while developing.

The same `serve run` also hosts a second application under /exact (`server.exact`): the same
server and pair in float32, with a KV pool far smaller than its batch needs. Checks that a
greedy output is unchanged by what else runs beside it (disconnect storms, KV exhaustion with
preemption) use it: in bf16 the fused attention kernel rounds differently with batch shape, so
a near-tie can flip a token; in float32 the outputs are token-identical.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import yaml

from bench.local_server import REPO, free_port, local_server, ray_env, serve_bin  # noqa: F401 (re-exported)
from engine.config import with_embedded_defaults

API_KEY = "e2e-secret-key"
START_TIMEOUT_S = 300


EXACT_APP = "specserve-exact"
EXACT_PREFIX = "/exact"
EXACT_KV_BLOCKS = 192  # 3,072 tokens: a few long sequences, far fewer than max_batch_size


def exact_app(app: dict) -> dict:
    """The /exact application: `app` in float32 with a fixed K, one replica with one thread and no CPU
    reservation (so the main app can still autoscale to both cores), a small KV pool, and
    oneDNN's matmuls in every pass (`forward_plan: torch`): their rows are bit-identical
    whatever the batch, which its solo-vs-batched checks rely on (the one-sequence kernel, which
    a measured plan may choose, rounds batch-1 passes differently from batched ones)."""
    app = copy.deepcopy(app)
    app.update(name=EXACT_APP, route_prefix=EXACT_PREFIX)
    app["args"]["served_model_name"] = EXACT_APP
    app["args"]["engine"].update(dtype="float32", num_threads=1, num_kv_blocks=EXACT_KV_BLOCKS,
                                 forward_plan="torch")
    # a fixed K: every step speculates, so its checks of speculation never meet a plain decode
    # chosen by this host's timings
    app["args"]["engine"]["speculative"]["spec_policy"] = "fixed"
    dep = app["deployments"][0]
    dep.pop("autoscaling_config", None)
    dep.update(num_replicas=1, ray_actor_options={"num_cpus": 0})
    dep["user_config"]["spec_policy"] = "fixed"
    return app


@dataclass
class Server:
    url: str  # http://127.0.0.1:<port>
    config_path: Path
    config: dict
    log_path: Path
    route_prefix: str = ""  # the application's route prefix ("" = the main app at /)
    app_name: str = "specserve"

    @property
    def exact(self) -> Server:
        """The float32 application in the same `serve run` (see the module docstring)."""
        return replace(self, route_prefix=EXACT_PREFIX, app_name=EXACT_APP)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url + self.route_prefix, headers=self.headers, **{"timeout": 120, **kw})

    def engine_kwargs(self) -> dict:
        """This application's EngineConfig fields, as `LLM(**kwargs)` takes them (the embedded
        pair where the config names no model)."""
        app = next(a for a in self.config["applications"] if a["name"] == self.app_name)
        return with_embedded_defaults(dict(app["args"]["engine"]))

    @property
    def max_seq_len(self) -> int:
        return self.config["applications"][0]["args"]["engine"]["max_seq_len"]

    def stats(self) -> dict:
        with self.client() as c:
            r = c.get("/v1/engine/stats")
            r.raise_for_status()
            return r.json()

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
    # kernel caches that fill within seconds, so a replica's memory is flat under load and the leak
    # check sees leaks, not caches filling (the shipped 512-entry bound climbs ~370 MiB over minutes
    # by design: docs/performance-notes.md#kernel-caches); serve_app keeps values already set
    env_vars["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env_vars["LRU_CACHE_CAPACITY"] = "64"
    overrides = os.environ.get("SPECSERVE_E2E_ENGINE")
    if overrides:
        app["args"]["engine"].update(json.loads(overrides))
    cfg["applications"].append(exact_app(app))
    with local_server(cfg, tmp_path_factory.mktemp("serve"), START_TIMEOUT_S) as run:
        server = Server(run.url, run.config_path, run.config, run.log_path)

        def exact_healthy() -> bool:
            try:
                return httpx.get(run.url + EXACT_PREFIX + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        server.wait_until(exact_healthy, START_TIMEOUT_S, f"the {EXACT_APP} application to be healthy")
        yield server
