"""The ingress + engine topology (serve_config.ingress.yaml) over real Serve, beside the shared
`serve run` of serve_config.yaml: `serve deploy` adds it as a third application under /ingress
(one engine replica, no CPU reservation) for this module and removes it afterwards.

It must serve the same OpenAI API as the single deployment (streaming and not, errors
OpenAI-shaped), give the same greedy text, abort a request whose client went away, and route
with the configured PrefixCacheAffinityRouter: the router's prefix tree holds what was sent.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace

import httpx
import openai
import pytest
import yaml

from bench.local_server import REPO, ray_env, serve_bin
from tests.serve_fixture import API_KEY

APP = "specserve-ingress"
PREFIX = "/ingress"
ROUTER = "serve_app.routing.PrefixCacheAffinityRouter"


def ingress_app(main_app: dict) -> dict:
    """serve_config.ingress.yaml's application as a test app: the main app's environment (API key,
    test hooks), one engine replica with one thread and no CPU reservation (the main app keeps
    both cores to autoscale on), under /ingress."""
    app = yaml.safe_load((REPO / "serve_config.ingress.yaml").read_text())["applications"][0]
    app.update(name=APP, route_prefix=PREFIX, runtime_env=copy.deepcopy(main_app.get("runtime_env", {})))
    app["args"]["engine"]["num_threads"] = 1
    engine = next(d for d in app["deployments"] if d["name"] == "LLMServer")
    engine.pop("autoscaling_config", None)
    engine.update(num_replicas=1, ray_actor_options={"num_cpus": 0})
    return app


def deploy(path) -> None:
    subprocess.run([serve_bin(), "deploy", str(path)], check=True, capture_output=True, timeout=120, env=ray_env())


@pytest.fixture(scope="module")
def ingress(server):
    cfg = copy.deepcopy(server.config)
    cfg["applications"].append(ingress_app(cfg["applications"][0]))
    path = server.config_path.with_name("serve_config_with_ingress.yaml")
    path.write_text(yaml.safe_dump(cfg))
    deploy(path)
    app = replace(server, route_prefix=PREFIX, app_name=APP, config=cfg)

    def healthy() -> bool:
        try:
            return httpx.get(server.url + PREFIX + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        server.wait_until(healthy, 300, "the ingress application to be healthy")
        yield app
    finally:
        deploy(server.config_path)  # the shared server's own config: the ingress app is removed


def sse(response: httpx.Response) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.iter_lines() if line.startswith("data: ")]


def test_completions_stream_and_not_and_equal_the_single_deployment(server, ingress):
    body = {"prompt": "def fibonacci(n):\n", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with ingress.client() as c:
        whole = c.post("/v1/completions", json=body)
        assert whole.status_code == 200, whole.text
        out = whole.json()
        assert out["usage"]["completion_tokens"] == 40 and out["choices"][0]["finish_reason"] == "length"
        assert out["speculation"]["method"] == "eagle"
        with c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse(r)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 40
    chunks = [e for e in events[:-2] if e["choices"]]
    assert len(chunks) > 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(e["choices"][0]["text"] for e in chunks)
    assert streamed == out["choices"][0]["text"]
    with server.client() as c:  # the single deployment, same engine configuration: the same greedy text
        single = c.post("/v1/completions", json=body).json()
    assert single["choices"][0]["text"] == out["choices"][0]["text"]


def test_openai_client_chat_and_completions_through_the_ingress(ingress):
    client = openai.OpenAI(base_url=ingress.url + PREFIX + "/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Write a Python function that adds two numbers."}]
    chat = client.chat.completions.create(model="specserve-default", messages=messages, max_tokens=24,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0
    pieces = list(client.chat.completions.create(model="specserve-default", messages=messages, max_tokens=24,
                                                 temperature=0, stream=True))
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == chat.choices[0].message.content
    text = client.completions.create(model="specserve-default", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert text.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in client.models.list().data] == ["specserve-default"]


def test_errors_are_openai_shaped_at_the_ingress_and_from_the_engine(ingress):
    with ingress.client() as c:
        bad = c.post("/v1/completions", json={"prompt": "", "max_tokens": 4})  # the ingress validates
        model = c.post("/v1/completions", json={"prompt": "x", "model": "nope"})  # the engine answers
        big_n = c.post("/v1/completions", json={"prompt": "x", "n": 1000})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert model.status_code == 404 and model.json()["error"]["code"] == "model_not_found"
    assert big_n.status_code == 400 and big_n.json()["error"]["param"] == "n"
    assert httpx.post(ingress.url + PREFIX + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(ingress.url + PREFIX + "/health").json()["status"] == "ok"


def test_a_client_gone_mid_stream_aborts_its_request_on_the_engine(ingress):
    body = {"prompt": "class Cache:\n", "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}
    with ingress.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        for n, _line in enumerate(r.iter_lines()):
            if n >= 6:
                break  # hang up mid-stream
    ingress.wait_until(lambda: ingress.stats()["running"] == 0 and not ingress.stats()["target_kv_used_slots"], 60,
                       "the abandoned request to be aborted on the engine replica")


def test_the_prefix_aware_router_is_applied_and_sees_the_prompt(ingress):
    """The engine deployment routes with the configured router: its prefix tree (a named actor
    per application and deployment) has the prompt this test sent, keyed to the replica that
    served it; the replica's prefix cache served the repeated prompt's blocks."""
    prompt = "# a module header that this test alone sends\n" * 6 + "def f():\n"
    with ingress.client() as c:
        for _ in range(2):
            assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}).status_code == 200
    assert ingress.stats()["prefix_cache"]["cached_tokens"] > 0
    script = (
        "import ray, json, sys\n"
        "ray.init(address='auto', logging_level='ERROR')\n"
        f"tree = ray.get_actor('LlmPrefixTreeActor', namespace='serve::{APP}::LLMServer')\n"
        "matched, tenants = ray.get(tree.prefix_match.remote(sys.argv[1]))\n"
        "print(json.dumps({'matched': len(matched), 'tenants': tenants}))\n")
    out = subprocess.run([sys.executable, "-c", script, prompt], capture_output=True, text=True, timeout=120, env=ray_env())
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["matched"] == len(prompt) and len(found["tenants"]) == 1, found
    deployed = yaml.safe_load(subprocess.run([serve_bin(), "config", "--name", APP], capture_output=True, text=True,
                                             timeout=60, env=ray_env()).stdout)
    engine = next(d for d in deployed["deployments"] if d["name"] == "LLMServer")
    assert engine["request_router_config"]["request_router_class"] == ROUTER
