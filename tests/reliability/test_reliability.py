"""Reliability under load, faults and hostile input, against a real `serve run` on loopback.

Every request loop here is bounded in count and in time and stops by itself; all traffic
goes to 127.0.0.1. CI mode: 32 streaming clients for 60 s; `pytest --soak`: 128 for 10 min.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import threading
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROMPTS = ["def parse(text):\n", "class Cache:\n    def __init__(self, size):\n",
           "import os\nimport sys\n\n\ndef main(argv):\n    paths = [p for p in argv if os.path.exists(p)]\n",
           "x = 1\n" * 16]


def stream(server, body: dict, drop_after: int | None = None, timeout_s: float = 300) -> dict:
    """Streams one completion. Returns {'text', 'done', 'finish', 'error', 'status'}."""
    out = {"text": "", "done": False, "finish": None, "error": None, "status": None}
    with server.client(timeout=timeout_s) as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = r.read().decode(errors="replace")
            return out
        for n, line in enumerate(r.iter_lines()):
            if drop_after is not None and n >= drop_after:
                return out  # hang up mid-stream
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            if chunk["choices"]:
                out["text"] += chunk["choices"][0]["text"]
                out["finish"] = chunk["choices"][0]["finish_reason"] or out["finish"]
    return out


def idle_on_every_replica(server, timeout_s: float = 120) -> list[dict]:
    """Polls the stats endpoint until every running replica reports no requests and no KV in use."""
    from tests.e2e.test_serve_ops import replica_states, serve_status

    seen: dict[str, dict] = {}

    def check():
        expected = replica_states(serve_status(), server.app_name).get("RUNNING", 1)
        s = server.stats()
        if s["running"] == 0 and s["waiting"] == 0 and not s["target_kv_used_blocks"] \
                and not s["target_kv_used_slots"] and not s.get("draft_kv_used_slots"):
            seen[s["replica"]] = s
        else:
            seen.pop(s["replica"], None)
        return len(seen) >= expected

    server.wait_until(check, timeout_s, "every replica to be idle with no KV in use")
    return list(seen.values())


def test_sustained_load_loses_nothing_and_leaks_nothing(server, soak):
    clients, duration = (128, 600) if soak else (32, 60)
    deadline = time.monotonic() + duration
    results: list[dict] = []
    rss: list[tuple[float, int, str]] = []
    missed: list[str] = []  # RSS samples the stats endpoint did not answer
    lock = threading.Lock()
    stop = threading.Event()

    def client(i: int):
        rng = random.Random(i)
        for n in range(10_000):  # bounded; the deadline ends it long before
            if time.monotonic() > deadline:
                return
            body = {"prompt": rng.choice(PROMPTS) * rng.randint(1, 3), "max_tokens": rng.randint(8, 96),
                    "temperature": rng.choice([0.0, 0.8]), "seed": i * 1000 + n, "top_p": 0.95}
            res = stream(server, body)
            with lock:
                results.append(res)

    def sample_rss():
        start = time.monotonic()
        while not stop.wait(2.0):
            try:
                s = server.stats()
            except httpx.HTTPError as exc:  # a shed or timed-out probe is one sample missed, said below
                missed.append(repr(exc))
                continue
            rss.append((time.monotonic() - start, s["rss_bytes"], s["replica"]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    sampler = threading.Thread(target=sample_rss)
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=duration + 300)
    stop.set()
    sampler.join()
    assert results, "no request completed"
    failures = [r for r in results if r["status"] != 200 or r["error"] or not r["done"] or r["finish"] != "length"
                and r["finish"] != "stop"]
    assert not failures, failures[:3]
    idle_on_every_replica(server)
    # memory: the last third of the run is not above the first third (per replica, +10% slack)
    by_replica: dict[str, list[tuple[float, int]]] = {}
    for t, value, replica in rss:
        by_replica.setdefault(replica, []).append((t, value))
    memory = []
    for samples in by_replica.values():
        if len(samples) < 6:
            continue
        # the test app bounds the kernel caches at 64 entries (tests/serve_fixture.py): memory is flat from the start
        third = len(samples) // 3
        first = statistics.median(v for _, v in samples[:third])
        last = statistics.median(v for _, v in samples[-third:])
        assert last <= first * 1.10, f"replica RSS grew from {first / 2**20:.0f} MiB to {last / 2**20:.0f} MiB"
        memory.append(f"{first / 2**20:.0f} -> {last / 2**20:.0f} MiB")
    assert memory, f"no replica answered enough RSS samples ({len(rss)} samples, missed: {missed[:3]})"
    print(f"\nload: {clients} clients x {duration}s -> {len(results)} requests, 0 errors; "
          f"replica RSS median first -> last third: {', '.join(memory)} ({len(rss)} samples, {len(missed)} missed)")


def test_disconnect_storm_leaks_nothing_and_does_not_disturb_others(server):
    """60 clients hang up at random points while 3 greedy streams run beside them (float32 app,
    speculation on): no KV is left behind and each greedy output equals its solo run."""
    exact = server.exact
    steady_prompts = PROMPTS[:3]
    body = {"max_tokens": 48, "temperature": 0}
    solo = [stream(exact, {**body, "prompt": p})["text"] for p in steady_prompts]
    together: dict[int, str] = {}

    def steady(i):
        together[i] = stream(exact, {**body, "prompt": steady_prompts[i]})["text"]

    def dropper(i):
        rng = random.Random(100 + i)
        stream(exact, {"prompt": rng.choice(PROMPTS), "max_tokens": 400, "temperature": 0.9, "seed": i,
                       "ignore_eos": True}, drop_after=rng.randint(0, 12))

    threads = [threading.Thread(target=dropper, args=(i,)) for i in range(60)]
    threads += [threading.Thread(target=steady, args=(i,)) for i in range(3)]
    random.Random(0).shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(together) == 3 and all(together[i] for i in range(3))
    assert [together[i] for i in range(3)] == solo
    idle_on_every_replica(exact)


def test_injected_fault_fails_only_its_request(server):
    results: dict[str, dict] = {}

    def run(name, body):
        results[name] = stream(server, body)

    normal = {"max_tokens": 32, "temperature": 0}
    threads = [threading.Thread(target=run, args=("fault", {**normal, "prompt": PROMPTS[0],
                                                            "user": "specserve-test-fault"}))]
    threads += [threading.Thread(target=run, args=(f"ok{i}", {**normal, "prompt": p})) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    fault = results.pop("fault")
    assert fault["status"] == 200 and fault["done"] and "injected fault" in fault["error"]["message"]
    assert all(r["done"] and not r["error"] and r["finish"] in ("stop", "length") for r in results.values())
    with server.client() as c:
        r = c.post("/v1/completions", json={**normal, "prompt": PROMPTS[1], "user": "specserve-test-fault"})
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    idle_on_every_replica(server)


# --- fuzzing -------------------------------------------------------------------------------
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                      st.floats(allow_nan=False), st.text(max_size=40))
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)
HOSTILE_TEXT = st.one_of(st.text(max_size=200), st.sampled_from(["", "\x00", "🚀" * 50, "\ud800", "😀stop😀", "a" * 5000]))
FIELDS = {
    "prompt": st.one_of(HOSTILE_TEXT, st.lists(st.integers(-5, 10**6), max_size=20), JSON_VALUE),
    "max_tokens": st.one_of(st.integers(-10, 8), st.integers(10**6, 10**18), JSON_VALUE),
    "temperature": st.one_of(st.floats(-5, 5, allow_nan=False), st.sampled_from([1e308, -1e308]), JSON_VALUE),
    "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), JSON_VALUE),
    "top_k": st.one_of(st.integers(-10, 10**9), JSON_VALUE),
    "stop": st.one_of(HOSTILE_TEXT, st.lists(HOSTILE_TEXT, max_size=20), JSON_VALUE),
    "seed": st.one_of(st.integers(-(2**70), 2**70), JSON_VALUE),
    "n": st.one_of(st.integers(-3, 5), JSON_VALUE),
    "stream": st.one_of(st.booleans(), JSON_VALUE),
    "model": st.one_of(st.just("specserve-default"), st.text(max_size=20), JSON_VALUE),
    "repetition_penalty": st.one_of(st.floats(-2, 200, allow_nan=False), JSON_VALUE),
    "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(
        ["user", "system", "assistant", "wizard", "", "tool"]), "content": st.one_of(HOSTILE_TEXT, JSON_VALUE)}),
        max_size=4), JSON_VALUE),
}
BODIES = st.one_of(
    st.fixed_dictionaries({}, optional=FIELDS),
    JSON_VALUE.map(json.dumps),
    st.binary(max_size=300),
    st.integers(1, 3000).map(lambda depth: "[" * depth + "]" * depth),
    st.text(max_size=300),
)
ROUTES = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
FUZZ_LOG: list[int] = []


@settings(max_examples=520, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(route=ROUTES, body=BODIES)
def test_fuzzed_requests_never_get_a_5xx(server, route, body):
    if isinstance(body, dict):
        if isinstance(body.get("max_tokens"), int) and 1 <= body["max_tokens"] <= 8 or "max_tokens" not in body:
            body = {**body, "max_tokens": body.get("max_tokens", 4)}
        content = json.dumps(body).encode()
    elif isinstance(body, str):
        content = body.encode("utf-8", errors="surrogatepass")
    else:
        content = body
    with server.client(timeout=120) as c:
        r = c.post(route, content=content, headers={"content-type": "application/json"})
        text = r.read()
    FUZZ_LOG.append(r.status_code)
    assert r.status_code < 500, (r.status_code, text[:300], content[:300])
    if r.headers.get("content-type", "").startswith("application/json"):
        obj = json.loads(text)
        if r.status_code >= 400:
            assert set(obj["error"]) == {"message", "type", "param", "code"}
        else:
            assert obj["choices"] and "usage" in obj
    else:
        assert r.status_code == 200 and text.rstrip().endswith(b"data: [DONE]")


def test_fuzzing_covered_enough_cases_and_server_is_healthy(server):
    assert len(FUZZ_LOG) >= 500
    assert httpx.get(server.url + "/health").status_code == 200
    codes = {c // 100 for c in FUZZ_LOG}
    assert codes <= {2, 4} and 4 in codes
    print(f"\nfuzz: {len(FUZZ_LOG)} requests, status classes {sorted(codes)}")


def unpreempted_greedy(app, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy texts of `prompts` from `app`'s engine configuration run in this process without
    speculation and with a KV pool that holds every sequence at once (nothing is preempted)."""
    from engine import LLM, SamplingParams

    kwargs = {k: v for k, v in app.engine_kwargs().items() if k not in ("num_kv_blocks", "num_threads")}
    kwargs.update(speculative={"use_speculative_decoding": False}, max_batch_size=len(prompts))
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.text for o in llm.generate(prompts, params)]


def test_more_long_requests_than_the_kv_pool_holds_all_finish_like_solo(server):
    """The float32 app's KV pool holds 3,072 tokens; 24 concurrent requests of ~420 tokens need
    ~10,000: requests queue, running ones are preempted and recomputed, all finish, and each
    greedy output equals its solo run: three against true solo runs over HTTP, all 24 against
    the engine in-process (float32, plain decode, a pool that holds them all; in float32 with
    oneDNN's matmuls, as the app is configured, a sequence's greedy tokens do not depend on its
    batch: the matmul rows are proven bit for bit in tests/unit)."""
    from tests.serve_fixture import EXACT_KV_BLOCKS

    exact = server.exact
    n, max_tokens = 24, min(400, server.max_seq_len - 200)
    bodies = [{"prompt": PROMPTS[i % 3] + f"# task {i}\n", "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True} for i in range(n)]
    checked = (0, 11, 23)
    solo = {i: stream(exact, bodies[i])["text"] for i in checked}
    preempted_before = exact.stats()["preemptions_total"]
    results: dict[int, dict] = {}

    def run(i):
        results[i] = stream(exact, bodies[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert len(results) == n and all(r["done"] and not r["error"] and r["finish"] == "length"
                                     for r in results.values())
    preemptions = exact.stats()["preemptions_total"] - preempted_before
    assert preemptions > 0, f"a {EXACT_KV_BLOCKS}-block pool should have forced preemption"
    assert {i: results[i]["text"] for i in checked} == solo
    reference = unpreempted_greedy(exact, [b["prompt"] for b in bodies], max_tokens)
    differing = [i for i in range(n) if results[i]["text"] != reference[i]]
    assert not differing, f"outputs {differing} differ from their unpreempted greedy decodes"
    print(f"\nbeyond KV capacity: {n} requests, {preemptions} preemptions, greedy outputs equal to solo: "
          f"{len(checked)}/{len(checked)} over HTTP, {n}/{n} equal to the in-process reference")
    idle_on_every_replica(exact)


def test_killed_replica_is_replaced_and_service_recovers(server):
    """Kills the engine replica's process mid-load: in-flight requests end cleanly (complete or
    a clean error), Serve starts a replacement, and requests after recovery succeed."""
    from tests.e2e.test_serve_ops import replica_states, serve_status

    pid = server.stats()["pid"]
    results: list[dict] = []
    lock = threading.Lock()

    def client(i):
        try:
            res = stream(server, {"prompt": PROMPTS[i % 3], "max_tokens": 200, "temperature": 0, "ignore_eos": True},
                         timeout_s=120)
        except httpx.HTTPError as exc:  # connection cut by the proxy: a clean transport error
            res = {"status": None, "error": repr(exc), "done": False}
        with lock:
            results.append(res)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    server.wait_until(lambda: server.stats()["running"] > 0, 60, "load on the replica")
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 8
    for r in results:  # each either completed or failed cleanly; none hung
        assert r["done"] or r["error"] or r["status"] != 200, r

    def recovered():
        try:
            with server.client(timeout=30) as c:
                r = c.post("/v1/completions", json={"prompt": "def ok():\n", "max_tokens": 4, "temperature": 0})
            return r.status_code == 200 and server.stats()["pid"] != pid
        except httpx.HTTPError:
            return False

    server.wait_until(recovered, 300, "a replacement replica to serve requests")
    recovery_s = time.monotonic() - killed_at
    assert replica_states(serve_status()).get("RUNNING", 0) >= 1
    ok = [stream(server, {"prompt": p, "max_tokens": 16, "temperature": 0}) for p in PROMPTS]
    assert all(r["done"] and not r["error"] for r in ok)
    print(f"\nreplica kill: recovered in {recovery_s:.1f} s")


def test_a_device_fault_fails_health_and_the_replica_is_replaced(server):
    """A simulated sticky CUDA error in one request's step: that request and every other one in
    flight end with a clear error, the replica's /health turns 503 (the engine loop stopped),
    Serve's health check replaces the replica, and requests after that succeed."""
    pid = server.stats()["pid"]
    results: dict[str, dict] = {}

    def run(name: str, body: dict) -> None:
        results[name] = stream(server, body, timeout_s=120)

    normal = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}
    threads = [threading.Thread(target=run, args=(f"normal{i}", {**normal, "prompt": PROMPTS[i]})) for i in range(2)]
    for t in threads:
        t.start()
    server.wait_until(lambda: server.stats()["running"] >= 2, 60, "two requests in flight")
    run("fault", {**normal, "prompt": PROMPTS[2], "user": "specserve-test-device-fault"})
    for t in threads:
        t.join(timeout=120)
    for name, r in results.items():
        message = r["error"]["message"] if isinstance(r["error"], dict) else str(r["error"])
        assert "device fault" in message, (name, r)

    def replaced() -> bool:
        try:
            return httpx.get(server.url + "/health", timeout=5).status_code == 200 and server.stats()["pid"] != pid
        except (httpx.HTTPError, KeyError, ValueError):
            return False

    server.wait_until(replaced, 300, "Serve to replace the faulted replica")
    ok = [stream(server, {"prompt": p, "max_tokens": 16, "temperature": 0}) for p in PROMPTS]
    assert all(r["done"] and not r["error"] for r in ok)
