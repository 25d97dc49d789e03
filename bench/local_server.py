"""Runs `serve run <config>` on loopback as a child process: used by the e2e tests and the HTTP benchmark.

`local_server(config, work)` writes the config (a dict shaped like serve_config.yaml) into `work`,
starts `serve run` in its own process group, waits until /health answers 200 (bounded), yields the
base URL, and on exit interrupts the group and stops the Ray cluster it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_env() -> dict:
    """Environment for `serve run/deploy/status`: Ray's token auth on for every client, so the
    CLI can talk to the dashboard of the cluster `serve run` started."""
    return {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}


def serve_bin() -> str:
    return str(Path(sys.executable).parent / "serve")


def ray_stop() -> None:
    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], env=ray_env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


@dataclass
class LocalServer:
    url: str
    config_path: Path
    config: dict
    log_path: Path


@contextmanager
def local_server(config: dict, work: Path, start_timeout_s: float = 300) -> Iterator[LocalServer]:
    """`serve run` of `config` on a free loopback port (config's http port is replaced)."""
    config = {**config, "http_options": {**config.get("http_options", {}), "host": "127.0.0.1", "port": free_port()}}
    work.mkdir(parents=True, exist_ok=True)
    config_path = work / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = work / "serve.log"
    ray_stop()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([serve_bin(), "run", str(config_path)], cwd=REPO, env=ray_env(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = LocalServer(f"http://127.0.0.1:{config['http_options']['port']}", config_path, config, log_path)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve run exited early:\n{log_path.read_text()[-3000:]}")
            if "Failed to update the deployments" in log_path.read_text():
                raise RuntimeError(f"the deployment failed:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the application was not healthy within {start_timeout_s}s; log: {log_path}")
            time.sleep(0.2)  # polling a child process's readiness, bounded by the deadline above
        yield server
    finally:
        stop_serve_run(proc)


def stop_serve_run(proc: subprocess.Popen) -> None:
    """Interrupts a `serve run` started in its own process group (killed if it has not stopped
    within a minute) and stops the Ray cluster it started."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    ray_stop()
