"""Operating the deployment: live reconfiguration through user_config, and autoscaling."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
from pathlib import Path

import yaml

from tests.serve_fixture import ray_env

SERVE = str(Path(sys.executable).parent / "serve")


def serve_status() -> dict:
    out = subprocess.run([SERVE, "status"], capture_output=True, text=True, timeout=60, env=ray_env())
    return yaml.safe_load(out.stdout) or {}


def replica_states(status: dict, app_name: str = "specserve") -> dict:
    app = (status.get("applications") or {}).get(app_name) or {}
    dep = (app.get("deployments") or {}).get("LLMServer") or {}
    return dep.get("replica_states") or {}


def stream_completion(server, body: dict, started: threading.Event | None = None) -> dict:
    """Streams one completion; returns {'text', 'done', 'final'}."""
    text, done, final = [], False, None
    with server.client() as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if started is not None:
                started.set()
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text.append(chunk["choices"][0]["text"])
            final = chunk
    return {"text": "".join(text), "done": done, "final": final}


def test_user_config_change_applies_live_without_dropping_streams(server):
    assert server.stats()["speculation"]["speculative_method"] == "eagle"
    started = threading.Event()
    result = {}

    def long_stream():
        result.update(stream_completion(server, {"prompt": "def parse(text):\n", "max_tokens": 300,
                                                 "temperature": 0, "ignore_eos": True}, started))

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(timeout=120)
    cfg = copy.deepcopy(server.config)
    cfg["applications"][0]["deployments"][0]["user_config"].update(speculative_method="ngram", spec_length=3)
    new_path = server.config_path.with_name("serve_config_ngram.yaml")
    new_path.write_text(yaml.safe_dump(cfg))
    subprocess.run([SERVE, "deploy", str(new_path)], check=True, capture_output=True, timeout=120, env=ray_env())
    server.wait_until(lambda: server.stats()["speculation"]["speculative_method"] == "ngram", 120,
                      "the new user_config to reach the replica")
    t.join(timeout=300)
    assert result["done"] and result["final"]["speculation"]["draft_tokens"] >= 0
    assert len(result["final"]["choices"]) == 1 and result["final"]["choices"][0]["finish_reason"] == "length"
    stats = server.stats()["speculation"]
    assert (stats["speculative_method"], stats["spec_length"]) == ("ngram", 3)
    # a new request speculates with the new method (a repetitive prompt gives n-gram matches)
    out = stream_completion(server, {"prompt": "x = 1\ny = 2\n" * 8, "max_tokens": 32, "temperature": 0})
    assert out["done"] and out["final"]["speculation"]["method"] == "ngram"
    # back to the shipped configuration for the remaining tests
    subprocess.run([SERVE, "deploy", str(server.config_path)], check=True, capture_output=True, timeout=120, env=ray_env())
    server.wait_until(lambda: server.stats()["speculation"]["speculative_method"] == "eagle", 120, "the original config")


def test_load_scales_to_a_second_replica_and_every_request_succeeds(server):
    # an earlier test's load may have scaled up; downscaling takes downscale_delay_s (60 s)
    server.wait_until(lambda: replica_states(serve_status()).get("RUNNING") == 1, 240,
                      "one replica before the load")
    results: list[dict] = []
    lock = threading.Lock()
    scaled = threading.Event()

    def client(i: int):
        for round_ in range(6):  # bounded: at most 6 requests per client
            out = stream_completion(server, {"prompt": f"def task_{i}_{round_}(items):\n",
                                             "max_tokens": min(400, server.max_seq_len - 32),
                                             "temperature": 0.8, "seed": i, "ignore_eos": True})
            with lock:
                results.append(out)
            if scaled.is_set():
                return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    try:
        server.wait_until(lambda: replica_states(serve_status()).get("RUNNING") == 2, 300,
                          "a second replica under load")
    finally:
        scaled.set()
        for t in threads:
            t.join(timeout=600)
    assert len(results) >= 40
    assert all(r["done"] for r in results)
    assert all(r["final"]["choices"][0]["finish_reason"] == "length" for r in results)
