"""A chat's messages and tools rendered as its chat template takes them (`render_messages`), for
templates that render tools and for those that do not."""

from __future__ import annotations

import json

from serve_app.tool_parsers.hermes import HERMES_CLOSE, HERMES_OPEN
from serve_app.tool_schemas import Tool

GENERIC_TOOLS_PROMPT = (
    "You can call functions. Their signatures, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call one, answer with its name and arguments as a JSON object inside tags, one call per tag:\n"
    '<tool_call>\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n</tool_call>')


def _arguments_object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # the template writes what the caller sent


def _message(m: dict, renders_tools: bool) -> dict:
    """One message (role, content, tool_calls, tool_call_id, name) for the template."""
    m = dict(m)
    calls = m.pop("tool_calls", None) or []
    if calls and renders_tools:
        m["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
            "name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}}
            for c in calls]
    elif calls:
        m["content"] = (m.get("content") or "") + "".join(
            f'{HERMES_OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
            f'{c["function"]["arguments"]}}}\n{HERMES_CLOSE}' for c in calls)
    if not renders_tools:
        m.pop("tool_call_id", None)
        m.pop("name", None)
    return m


def render_messages(messages: list[dict], tools: list[Tool], renders_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """Messages for the chat template, and the `tools=` it takes. A template that renders tools
    (Llama 3.1+, Qwen2.5/3, Mistral) gets them as `tools=` and earlier calls as `tool_calls`; one
    that does not (the embedded pair's) gets None, the tools in a system message asking for the
    Hermes format, and earlier calls written in it."""
    out = [_message(m, renders_tools) for m in messages]
    if not tools:
        return out, None
    specs = [t.model_dump(exclude_none=True) for t in tools]
    if renders_tools:
        return out, specs
    prompt = GENERIC_TOOLS_PROMPT.format(tools="\n".join(json.dumps(s) for s in specs))
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None
