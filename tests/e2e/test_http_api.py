"""The OpenAI-compatible API over a real `serve run serve_config.yaml` (loopback only)."""

from __future__ import annotations

import json
import threading
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from tests.serve_fixture import API_KEY
from tests.serve_fixture import EXACT_APP as EXACT_MODEL

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef main():\n"]


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture(scope="module")
def offline_reference(server):
    """Greedy outputs of the same engine configuration in-process (`LLM().generate`), one
    request at a time. Both sides decode without speculation (HTTP: `spec_length: 0`): in
    bf16 a verify pass over K+1 positions may round differently from single-token decode, so
    only identical computations are compared bit for bit here; speculative == plain greedy is
    proven token for token in fp32 by the unit and integration suites."""
    from engine import LLM, SamplingParams

    fields = ("dtype", "one_sequence_kernel", "token_step", "token_step_rows")
    plans = {role: {k: p[k] for k in fields if k in p} for role, p in server.stats()["forward_plan"].items()
             if role in ("target", "draft")}
    # the replica's own plan: a plan measured here, at another thread count, may choose another dtype
    llm = LLM(**{**server.engine_kwargs(), "forward_plan": plans})
    params = SamplingParams(temperature=0.0, max_tokens=48, spec_length=0)
    return {p: llm.generate(p, params)[0].text for p in PROMPTS}


def test_models_and_health(server):
    with server.client() as c:
        health = c.get("/health").json()
        assert health["status"] == "ok" and {"models", "kv_pools"} <= set(health["startup_s"])
        pending = health["calibration_pending"]  # the sizes past batch 1 are measured, one a call, while idle
        assert pending in ([], [32], [16, 32], [4, 16, 32]), pending
        models = c.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "specserve-default"


def test_completion_stream_is_incremental_and_ends_with_usage_then_done(server):
    body = {"model": "specserve-default", "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        # the first chunk is here while the request is still generating
        assert server.stats()["running"] >= 1
        rest = [first] + [line for line in lines if line.startswith("data: ")]
    events = [e if e == "data: [DONE]" else json.loads(e[6:]) for e in rest]
    assert events[-1] == "data: [DONE]"
    chunks = events[:-1]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert sum(1 for t in texts if t) >= 3
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 120
    spec = last["speculation"]
    assert spec["draft_tokens"] >= spec["accepted_tokens"] >= 0 and spec["rounds"] >= 1
    assert 0.0 <= spec["acceptance_rate"] <= 1.0
    steps = sum(spec["k_histogram"].values())  # decode steps by the K chosen for this request
    assert steps >= spec["rounds"] and spec["mean_k"] == sum(int(k) * n for k, n in spec["k_histogram"].items()) / steps
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_http_greedy_equals_offline_generate(server, offline_reference):
    with server.client() as c:
        for prompt in PROMPTS:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 48, "temperature": 0,
                                                "spec_length": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == offline_reference[prompt]
            body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": True, "spec_length": 0}
            with c.stream("POST", "/v1/completions", json=body) as r:
                streamed = sse_events(r)
            assert "".join(e["choices"][0]["text"] for e in streamed[:-1] if e["choices"]) == offline_reference[prompt]


def test_openai_client_completions_and_chat(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    comp = client.completions.create(model="specserve-default", prompt=PROMPTS[1], max_tokens=16, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage.completion_tokens >= 1
    assert comp.model_extra["speculation"]["rounds"] >= 0
    chat = client.chat.completions.create(model="specserve-default", max_tokens=16, temperature=0.7, seed=3,
                                          messages=[{"role": "user", "content": "write a sort function"}])
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens > 5
    pieces, last = [], None
    for chunk in client.chat.completions.create(model="specserve-default", max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "hello"}]):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        last = chunk
    assert pieces and last.usage is not None and "speculation" in last.model_extra
    for chunk in client.completions.create(model="specserve-default", prompt=PROMPTS[2], max_tokens=8,
                                           stream=True):
        assert chunk.object == "text_completion"


def test_disconnecting_clients_free_kv_and_do_not_disturb_others(server, offline_reference):
    results: dict[str, str] = {}

    def steady(prompt):
        with server.client() as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 48, "temperature": 0})
            results[prompt] = r.json()

    def quitter(i):
        body = {"prompt": PROMPTS[i % 3] * (1 + i % 2), "max_tokens": 300, "temperature": 0.8, "seed": i,
                "ignore_eos": True, "stream": True}
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            for n, _line in enumerate(r.iter_lines()):
                if n >= 2 + i % 5:
                    break  # hang up mid-stream

    threads = [threading.Thread(target=quitter, args=(i,)) for i in range(20)]
    threads += [threading.Thread(target=steady, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    # the concurrent clients finished normally; their text equals the solo run bit for bit in
    # fp32 (unit suite) — in bf16 batch composition may flip near-ties, so count, don't assert
    assert all(r["choices"][0]["finish_reason"] in ("stop", "length") and r["usage"]["completion_tokens"] >= 1
               for r in results.values()) and len(results) == len(PROMPTS)
    same = sum(results[p]["choices"][0]["text"] == offline_reference[p] for p in PROMPTS)
    print(f"\nconcurrent greedy outputs equal to solo: {same}/{len(PROMPTS)}")
    stats = server.wait_until(lambda: (s := server.stats())["running"] == 0 and s["waiting"] == 0 and s,
                              60, "aborted requests to leave the engine")
    assert stats["target_kv_used_blocks"] == 0 and stats["target_kv_used_slots"] == 0
    assert stats.get("draft_kv_used_slots", 0) == 0


BAD_INPUTS = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("body not an object", "/v1/completions", b'["x"]', 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature not a number", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("prompt + max_tokens too long", "/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, None),
    ("n = 0", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("n above max_n", "/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("top_k below -1", "/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [1, 10**9]}, 400, None),
    ("too many stop strings", "/v1/completions", {"prompt": "x", "stop": ["a"] * 50}, 400, "stop"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("huge body", "/v1/completions", {"prompt": "x" * (2 << 20)}, 413, None),
    ("deeply nested JSON", "/v1/completions", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("wrong method", "/v1/completions", None, 405, None),
    ("json_schema without schema", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    ("unsupported schema keyword", "/v1/completions", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "not": {"const": 2}}}}},
     400, "response_format"),
    ("invalid schema", "/v1/completions", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, 400, "response_format"),
    ("regex that does not compile", "/v1/completions", {"prompt": "x", "guided_regex": "(("}, 400, "guided_regex"),
    ("oversized grammar", "/v1/completions", {"prompt": "x", "guided_regex": "a" * 70000}, 400, "guided_regex"),
    ("unknown response_format type", "/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}},
     400, "response_format"),
    ("tool_choice naming no tool", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("a tool schema the grammar refuses", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "not": {"const": 2}}}}],
     "tool_choice": "required"}, 400, "tools"),
    ("legacy functions (refused, not ignored)", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("logprobs above 20", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "top_logprobs": 2}, 400, "top_logprobs"),
    ("presence_penalty above 2", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("logit_bias key not a token id", "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias value above 100", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ("logit_bias token out of vocabulary", "/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 1}},
     400, None),
    ("echo with stream", "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_openai_shaped_4xx(server, name, path, body, status, param):
    with server.client() as c:
        if body is None:
            r = c.get(path)
        elif isinstance(body, bytes):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = c.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param
    if name == "prompt + max_tokens too long":
        assert "100000" in err["message"] and "max_seq_len" in err["message"]


def test_missing_or_wrong_api_key_is_401_and_health_stays_open(server):
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    kind: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=30)
    vaccinated: bool


def test_openai_client_structured_outputs_parse_and_validate(server):
    """`response_format` through the official client: json_schema (its parse helper with a pydantic
    model), json_object, streaming; every output parses and validates."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    messages = [{"role": "user", "content": "describe a pet as JSON"}]
    parsed = client.chat.completions.parse(model="specserve-default", messages=messages, response_format=Pet,
                                           temperature=0.7, seed=4, max_tokens=128)
    assert parsed.choices[0].finish_reason == "stop" and isinstance(parsed.choices[0].message.parsed, Pet)
    obj = client.chat.completions.create(model="specserve-default", messages=messages, max_tokens=128,
                                         temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason in ("stop", "length")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    schema = Pet.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    text = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="specserve-default", prompt=PROMPTS[0], max_tokens=128, temperature=0.9, seed=1, stream=True,
        extra_body={"response_format": fmt}) if chunk.choices)
    Pet.model_validate_json(text)


def test_concurrent_constrained_and_free_requests_under_adaptive_speculation(server):
    """Mixed load: constrained requests (two schemas, a choice list) beside unconstrained ones, all
    at once; each constrained output validates against its own grammar."""
    small = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["n"]}
    bodies = []
    for i in range(12):
        kind = i % 4
        body = {"prompt": PROMPTS[i % 3], "max_tokens": 96, "temperature": 0.8, "seed": i}
        if kind == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}}
        elif kind == 1:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": small}}
        elif kind == 2:
            body["guided_choice"] = ["yes", "no", "maybe later"]
        bodies.append(body)
    results: list = [None] * len(bodies)

    def send(i: int) -> None:
        with server.client() as c:
            results[i] = c.post("/v1/completions", json=bodies[i], timeout=300).json()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in enumerate(results):
        choice = r["choices"][0]
        if i % 4 == 0:
            Pet.model_validate_json(choice["text"])
        elif i % 4 == 1:
            assert 0 <= json.loads(choice["text"])["n"] <= 9
        elif i % 4 == 2:
            assert choice["text"] in ("yes", "no", "maybe later") and choice["finish_reason"] == "stop"
        else:
            assert choice["finish_reason"] in ("stop", "length")


def test_logprobs_echo_and_penalties_through_the_openai_client(server):
    """Completions logprobs (with echo scoring the prompt, max_tokens 0), chat logprobs and
    top_logprobs, streamed and not; in float32 (/exact) speculation's logprobs equal plain decoding's."""
    exact = server.exact
    client = openai.OpenAI(base_url=exact.url + exact.route_prefix + "/v1", api_key=API_KEY)
    runs = {}
    for spec_length in (0, None):
        extra = {} if spec_length is None else {"spec_length": spec_length}
        comp = client.completions.create(model=EXACT_MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                         logprobs=2, extra_body=extra)
        lp = comp.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens
        assert "".join(lp.tokens) == comp.choices[0].text and all(len(t) <= 2 for t in lp.top_logprobs)
        runs[spec_length] = lp.token_logprobs
    assert runs[0] == pytest.approx(runs[None], abs=1e-4)
    scored = client.completions.create(model=EXACT_MODEL, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == PROMPTS[1] and choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == scored.usage.prompt_tokens and scored.usage.completion_tokens == 0
    assert all(v <= 0 for v in choice.logprobs.token_logprobs[1:])
    chat = client.chat.completions.create(model=EXACT_MODEL, max_tokens=12, temperature=0, logprobs=True,
                                          top_logprobs=2, messages=[{"role": "user", "content": "hello"}])
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    streamed = [c for chunk in client.chat.completions.create(
        model=EXACT_MODEL, max_tokens=12, temperature=0, logprobs=True, stream=True,
        messages=[{"role": "user", "content": "hello"}]) if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    penalised = client.completions.create(model=EXACT_MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0)
    plain = client.completions.create(model=EXACT_MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert penalised.choices[0].text != plain.choices[0].text


def test_n_choices_are_distinct_samples_reproducible_by_seed_and_stream_by_index(server):
    """n samples of one prompt; a seeded request repeats them (spec_length 0: under adaptive
    speculation the K chosen, and so the draws a sample consumes, depend on timing)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    plain = {"spec_length": 0}

    def four(seed=None):
        return client.completions.create(model="specserve-default", prompt=PROMPTS[0], max_tokens=16, temperature=1.0,
                                         n=4, seed=seed, extra_body=plain)

    first = four(seed=11)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert len(set(texts)) == 4  # four samples, not one repeated
    assert [c.text for c in sorted(four(seed=11).choices, key=lambda c: c.index)] == texts
    lengths = [len(c.text) for c in first.choices]
    assert first.usage.completion_tokens >= 4 and first.usage.prompt_tokens < first.usage.completion_tokens + 64
    assert min(lengths) > 0
    pieces: dict[int, str] = {}
    finished = set()
    last = None
    for chunk in client.chat.completions.create(model="specserve-default", max_tokens=12, temperature=1.0, n=2,
                                                 seed=5, stream=True, stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "hello"}], extra_body=plain):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
        last = chunk
    assert finished == {0, 1} and last.usage is not None and last.usage.completion_tokens > 0
    whole = client.chat.completions.create(model="specserve-default", max_tokens=12, temperature=1.0, n=2, seed=5,
                                           messages=[{"role": "user", "content": "hello"}], extra_body=plain)
    assert [pieces[i] for i in (0, 1)] == [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)  # bounded, so a small model's call fits max_tokens
    unit: Literal["celsius", "fahrenheit"]


class GetTime(pydantic.BaseModel):
    timezone: str = pydantic.Field(max_length=16)


def test_tool_calls_named_and_required_parse_with_the_openai_client_under_speculation(server):
    """A named and a `required` tool choice through the official client's parse helper (strict
    pydantic tools), speculation on; streamed deltas reassemble to the non-streamed call (fp32,
    greedy); the call answered by a `tool` message continues the conversation."""
    exact = server.exact
    client = openai.OpenAI(base_url=exact.url + exact.route_prefix + "/v1", api_key=API_KEY)
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "GetWeather"}}
    call = client.chat.completions.parse(model=EXACT_MODEL, messages=messages, tools=tools, tool_choice=named,
                                         temperature=0, max_tokens=64)
    choice = call.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.speculation["draft_tokens"] > 0  # speculation was on
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "GetWeather" and isinstance(tool_call.function.parsed_arguments, GetWeather)
    pieces: dict[int, dict] = {}
    for chunk in client.chat.completions.create(model=EXACT_MODEL, messages=messages, tools=tools, tool_choice=named,
                                                temperature=0, max_tokens=64, stream=True):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            piece = pieces.setdefault(delta_call.index, {"id": "", "name": "", "arguments": ""})
            piece["id"] += delta_call.id or ""
            piece["name"] += delta_call.function.name or ""
            piece["arguments"] += delta_call.function.arguments or ""
    assert list(pieces) == [0] and pieces[0]["id"].startswith("call_")
    assert (pieces[0]["name"], pieces[0]["arguments"]) == (tool_call.function.name, tool_call.function.arguments)

    required = client.chat.completions.parse(model=EXACT_MODEL, messages=messages, tools=tools, tool_choice="required",
                                             parallel_tool_calls=False, temperature=0.8, seed=3, max_tokens=128)
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].finish_reason == "tool_calls"
    for c in calls:
        assert isinstance(c.function.parsed_arguments, {"GetWeather": GetWeather, "GetTime": GetTime}[c.function.name])
    answered = client.chat.completions.create(model=EXACT_MODEL, tools=tools, temperature=0, max_tokens=16, messages=[
        *messages, choice.message.model_dump(exclude_none=True, exclude={"parsed"}),
        {"role": "tool", "tool_call_id": tool_call.id, "content": '{"temperature": 21}'}], tool_choice="none")
    assert answered.choices[0].finish_reason in ("stop", "length") and answered.choices[0].message.tool_calls is None
