"""Every field of OpenAI's completions and chat-completions request bodies, as the pinned `openai`
package defines them, sent to a real `serve run`: each either takes effect (a check that would
fail were it ignored) or gets a 400 naming it. A field OpenAI adds fails `test_the_table_covers_
the_spec` until it is given a row."""

from __future__ import annotations

import json
import typing

import pytest
from tokenizers import Tokenizer

from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from tests.serve_fixture import REPO

MODEL = "specserve-default"
COMPLETION = {"model": MODEL, "prompt": "def fibonacci(n):\n", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "write a python function"}], "max_tokens": 12,
        "temperature": 0, "ignore_eos": True}
FORCED = 100  # a token id logit_bias forces


def spec_fields(route: str) -> set[str]:
    """The request body's fields in the installed openai package (`stream` is in its streaming variant)."""
    if route == "chat":
        from openai.types.chat import completion_create_params as params
    else:
        from openai.types import completion_create_params as params
    return set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


class Call:
    """Posts bodies to one route of the server, caching the answers of identical bodies."""

    def __init__(self, client, route: str):
        self.client, self.route, self.base, self._seen = client, route, (CHAT if route == "chat" else COMPLETION), {}

    def __call__(self, **patch):
        body = {**self.base, **patch}
        key = json.dumps(body, sort_keys=True)
        if key not in self._seen:
            path = "/v1/chat/completions" if self.route == "chat" else "/v1/completions"
            r = self.client.post(path, json=body)
            self._seen[key] = (r.status_code, r.text if body.get("stream") else r.json())
        return self._seen[key]

    def ok(self, **patch):
        status, body = self(**patch)
        assert status == 200, body
        return body

    def text(self, **patch) -> str:
        choice = self.ok(**patch)["choices"][0]
        return choice["message"]["content"] if self.route == "chat" else choice["text"]


def refused(**patch):
    def check(call: Call, field: str):
        status, body = call(**patch)
        assert status == 400 and body["error"]["param"] == field, body
    return check


def differs(**patch):
    """Takes effect: the answer differs from the same request without it (or with the base's value)."""
    def check(call: Call, field: str):
        without = {k: v for k, v in patch.items() if k != field}
        assert call.text(**patch) != call.text(**without, **({field: call.base[field]} if field in call.base else {}))
    return check


def tenant(value: str):
    """Takes effect as the request's tenant (whose earlier answers inform suffix proposals)."""
    def check(call: Call, field: str):
        call.ok(**{field: value})
        schema = ChatCompletionRequest if call.route == "chat" else CompletionRequest
        assert schema.model_validate({**call.base, field: value}).sampling_params(16).tenant == value
    return check


def _model(call, field):
    call.ok(model=MODEL)
    status, body = call(model="no-such-model")
    assert status == 404 and body["error"]["param"] == "model"


def _temperature(call, field):
    assert call.text(temperature=0, seed=1) == call.text(temperature=0, seed=2)
    assert call.text(temperature=1.5, seed=1) != call.text(temperature=0, seed=1)


def _top_p(call, field):
    assert call.text(temperature=1.0, top_p=1e-9, seed=3) == call.text()


def _seed(call, field):
    assert call.text(temperature=1.0, seed=7) == call.text(temperature=1.0, seed=7)
    assert call.text(temperature=1.0, seed=7) != call.text(temperature=1.0, seed=8)


def _logit_bias(call, field):
    forced = Tokenizer.from_file(str(REPO / "models/target/tokenizer.json")).decode([FORCED] * 12)
    assert call.text(logit_bias={str(FORCED): 100}) == forced


def _length(name):
    def check(call, field):
        assert call.ok(**{name: 3})["usage"]["completion_tokens"] == 3
    return check


def _n(call, field):
    assert len(call.ok(n=2, temperature=1.0, seed=1)["choices"]) == 2


def _stop(call, field):
    full = call.text(max_tokens=24)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    choice = call.ok(max_tokens=24, stop=[stop])["choices"][0]
    text = choice["message"]["content"] if call.route == "chat" else choice["text"]
    assert choice["finish_reason"] == "stop" and text == full[:full.index(stop)]


def _stream(call, field):
    status, text = call(stream=True)
    assert status == 200 and text.rstrip().endswith("data: [DONE]") and text.count("data: ") > 2


def _stream_options(call, field):
    _, text = call(stream=True, stream_options={"include_usage": True})
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    _, text = call(stream=True, stream_options={"include_obfuscation": True})
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert all(isinstance(c.get("obfuscation"), str) for c in chunks)
    assert len({len(c["obfuscation"]) for c in chunks}) > 1


def _echo(call, field):
    assert call.text(echo=True).startswith(COMPLETION["prompt"])


def _completion_logprobs(call, field):
    logprobs = call.ok(logprobs=2)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 12 and all(len(top) == 2 for top in logprobs["top_logprobs"])


def _chat_logprobs(call, field):
    content = call.ok(logprobs=True)["choices"][0]["logprobs"]["content"]
    assert len(content) == 12 and all("logprob" in t for t in content)


def _top_logprobs(call, field):
    content = call.ok(logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    assert all(len(t["top_logprobs"]) == 3 for t in content)


def _service_tier(call, field):
    assert call.ok(service_tier="auto")["service_tier"] == "default"
    refused(service_tier="flex")(call, field)


def _accepts(ok: dict, bad: dict):
    """Accepted at the value that asks for what the server does; refused at another."""
    def check(call, field):
        call.ok(**ok)
        refused(**bad)(call, field)
    return check


def _messages(call, field):
    longer = [{"role": "system", "content": "You write Python."}, *CHAT["messages"]]
    assert call.ok(messages=longer)["usage"]["prompt_tokens"] > call.ok()["usage"]["prompt_tokens"]
    status, body = call(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])
    assert status == 400 and body["error"]["param"] == "messages[0].content[1]"
    assert body["error"]["message"] == "messages[0].content[1]: only text content parts are served, got type 'image_url'"


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


def _tools(call, field):
    message = call.ok(max_tokens=48, ignore_eos=False, tools=[TOOL], tool_choice="required")["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "lookup"


def _tool_choice(call, field):
    named = {"type": "function", "function": {"name": "lookup"}}
    message = call.ok(max_tokens=48, ignore_eos=False, tools=[TOOL], tool_choice=named)["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["lookup"]
    assert "tool_calls" not in call.ok(max_tokens=48, ignore_eos=False, tools=[TOOL], tool_choice="none")["choices"][0]["message"]


def _parallel_tool_calls(call, field):
    # spec_length 0: seeded text varies with the K the adaptive policy takes, which timing decides
    message = call.ok(max_tokens=192, ignore_eos=False, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                      temperature=1.0, seed=4, spec_length=0)["choices"][0]["message"]
    assert len(message["tool_calls"]) == 1


def _response_format(call, field):
    text = call.text(max_tokens=64, response_format={"type": "json_object"}, ignore_eos=False)
    assert text.lstrip()[:1] in ("{", "[")


COMMON = {
    "model": _model, "temperature": _temperature, "top_p": _top_p, "seed": _seed, "logit_bias": _logit_bias,
    "n": _n, "stop": _stop, "stream": _stream, "stream_options": _stream_options,
    "frequency_penalty": differs(frequency_penalty=2.0, max_tokens=24),
    "presence_penalty": differs(presence_penalty=2.0, max_tokens=24),
    "user": tenant("team-a"), "max_tokens": _length("max_tokens"),
}
FIELDS = {
    "completions": {**COMMON, "prompt": differs(prompt="class Stack:\n"), "echo": _echo,
                    "logprobs": _completion_logprobs, "best_of": _accepts({"best_of": 1}, {"best_of": 2}),
                    "suffix": refused(suffix="\n    return x")},
    "chat": {**COMMON, "messages": _messages, "logprobs": _chat_logprobs, "top_logprobs": _top_logprobs,
             "max_completion_tokens": _length("max_completion_tokens"), "tools": _tools, "tool_choice": _tool_choice,
             "parallel_tool_calls": _parallel_tool_calls, "response_format": _response_format,
             "safety_identifier": tenant("user-1"), "prompt_cache_key": tenant("conversation-9"),
             "service_tier": _service_tier, "store": _accepts({"store": False}, {"store": True}),
             "metadata": _accepts({"metadata": {}}, {"metadata": {"team": "a"}}),
             "modalities": _accepts({"modalities": ["text"]}, {"modalities": ["text", "audio"]}),
             "prompt_cache_retention": _accepts({"prompt_cache_retention": "in_memory"},
                                                {"prompt_cache_retention": "24h"}),
             "prompt_cache_options": _accepts({"prompt_cache_options": {"mode": "implicit"}},
                                              {"prompt_cache_options": {"mode": "explicit"}}),
             "audio": refused(audio={"voice": "alloy", "format": "wav"}),
             "prediction": refused(prediction={"type": "content", "content": "x"}),
             "reasoning_effort": refused(reasoning_effort="low"), "verbosity": refused(verbosity="low"),
             "web_search_options": refused(web_search_options={"search_context_size": "low"}),
             "moderation": refused(moderation={"model": "omni-moderation-latest"}),
             "functions": refused(functions=[TOOL["function"]]), "function_call": refused(function_call="auto")},
}
ROWS = [(route, field) for route, table in FIELDS.items() for field in sorted(table)]


@pytest.mark.parametrize("route", sorted(FIELDS))
def test_the_table_covers_the_spec(route):
    assert set(FIELDS[route]) == spec_fields(route)


@pytest.fixture(scope="module")
def calls(server):
    with server.client() as client:
        yield {route: Call(client, route) for route in FIELDS}


@pytest.mark.parametrize("route,field", ROWS)
def test_each_field_takes_effect_or_is_refused_by_name(calls, route, field):
    FIELDS[route][field](calls[route], field)


@pytest.mark.parametrize("route", sorted(FIELDS))
def test_a_field_outside_the_api_is_refused_by_name(calls, route):
    status, body = calls[route](max_token=5)
    assert status == 400 and body["error"]["param"] == "max_token" and "unknown field" in body["error"]["message"]
