"""Tool calls on chat: the request's `tools` and `tool_choice`, the prompt they render into, the
grammar that enforces `required` and named choices, and the reader that turns the model's text
(whole or streamed) into OpenAI `tool_calls`.

- `none`: the tools are rendered (the conversation may refer to them), the output is plain text.
- a named function: the output is that function's arguments, enforced by its JSON schema.
- `required`: the output is a JSON array of calls `[{"name", "arguments"}]` (one call unless
  `parallel_tool_calls`), each call's arguments enforced by its function's schema.
- `auto`: the model writes text or calls in its family's format (FORMATS), read as they come.

Enforced choices use the structured-output grammar, so they stay exact under speculation. A chat
template that renders tools (Llama 3.1+, Qwen2.5/3, Mistral) gets them as `tools=`; one that does
not (the embedded pair's) gets them in a system message that asks for the Hermes format.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.structured_output import StructuredOutput

MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
Format = Literal["hermes", "llama3_json", "mistral"]
FORMATS: tuple[str, ...] = ("hermes", "llama3_json", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str  # letters, digits, _ and -, at most 64
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object (absent: no arguments)
    strict: bool | None = None  # every schema is enforced wholly when a call is required; accepted

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOOL_NAME.match(v):
            raise ValueError(f"function names are 1-64 letters, digits, '_' or '-', got {v!r}")
        return v

    def arguments_schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]  # the only kind of tool
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # the arguments as a JSON text


class ToolCall(BaseModel):
    """A call in an assistant message of the conversation (as the server returned it)."""
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolSet(BaseModel):
    """A request's tools and how it asks them to be used (validated together)."""
    tools: list[Tool] = Field(default_factory=list, max_length=MAX_TOOLS)
    choice: ToolChoice = "none"
    parallel: bool = True

    @property
    def mode(self) -> Literal["none", "auto", "required", "named"]:
        return "named" if isinstance(self.choice, NamedToolChoice) else self.choice

    def index_of(self, name: str) -> int:
        return next(i for i, t in enumerate(self.tools) if t.function.name == name)

    def check(self) -> tuple[str, str] | None:
        """(param, message) of the first problem, or None."""
        names = [t.function.name for t in self.tools]
        for i, name in enumerate(names):
            if name in names[:i]:
                return f"tools[{i}].function.name", f"two tools are named {name!r}"
        if self.mode in ("required", "named") and not self.tools:
            return "tool_choice", f"tool_choice {self.mode!r} needs tools"
        if self.mode == "named" and self.choice.function.name not in names:
            return "tool_choice", f"tool_choice names {self.choice.function.name!r}, which is not in tools {names}"
        return None

    def grammar(self) -> tuple[StructuredOutput, str] | None:
        """The structured output enforcing a required or named choice, and the field its schema
        errors name; None for `none` and `auto`."""
        if self.mode == "named":
            i = self.index_of(self.choice.function.name)
            return (StructuredOutput.json_schema(self.tools[i].function.arguments_schema()),
                    f"tools[{i}].function.parameters")
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                       "arguments": t.function.arguments_schema()},
                      "required": ["name", "arguments"]} for t in self.tools]
            array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutput.json_schema(array), "tools"
        return None


def tool_format(chat_template: str | None) -> tuple[Format, bool]:
    """The family's call format read off its chat template, and whether the template renders tools."""
    template = chat_template or ""
    renders = "tools" in template
    if MISTRAL_MARK in template:
        return "mistral", renders
    if HERMES_OPEN in template:
        return "hermes", renders
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json", renders
    return "hermes", renders


GENERIC_TOOLS_PROMPT = (
    "You can call functions. Their signatures, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call one, answer with its name and arguments as a JSON object inside tags, one call per tag:\n"
    '<tool_call>\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n</tool_call>')


def _arguments_object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # the template writes what the caller sent


def render_messages(messages: list[dict], tools: list[Tool], renders_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """Messages (role, content, tool_calls, tool_call_id, name) for the chat template, and the
    `tools=` it takes (None where it renders none: they go into a system message instead)."""
    out = []
    for m in messages:
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
        out.append(m)
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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _holdback(text: str, marker: str) -> int:
    """Characters at the end of `text` that could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallReader:
    """One choice's output text, fed as it arrives, as OpenAI message deltas: `{"content": ...}`
    and/or `{"tool_calls": [...]}` (a call's first entry carries its id, type and name). Streamed
    deltas concatenate to the whole-text result (`content`, `calls`); a call that does not parse
    stays text, so nothing the model wrote is lost."""

    def __init__(self, tools: ToolSet, fmt: Format, new_id: Callable[[], str] = new_call_id):
        self.mode = tools.mode
        self.format = fmt
        self.named = tools.choice.function.name if self.mode == "named" else None
        self._new_id = new_id
        self._text = ""  # everything fed
        self._done = 0  # characters of _text already turned into deltas
        self.content = ""
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}
        self._tool_mode = False  # auto: the output has begun a call

    # --- feeding ---------------------------------------------------------------------
    def feed(self, text: str) -> dict:
        self._text += text
        if self.mode == "named":
            return self._named(text)
        if self.mode == "required":
            return self._json_calls(final=False)
        if self.mode == "auto":
            return self._auto(final=False)
        return self._content(text)

    def finish(self) -> dict:
        if self.mode == "required":
            return self._json_calls(final=True)
        if self.mode == "auto":
            return self._auto(final=True)
        return {}

    # --- modes -----------------------------------------------------------------------
    def _content(self, text: str) -> dict:
        self.content += text
        self._done = len(self._text)
        return {"content": text} if text else {}

    def _named(self, text: str) -> dict:
        if not self.calls:
            self.calls.append({"id": self._new_id(), "type": "function",
                               "function": {"name": self.named, "arguments": text}})
            return {"tool_calls": [{"index": 0, **self.calls[0], "function": dict(self.calls[0]["function"])}]}
        self.calls[0]["function"]["arguments"] += text
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def _add_call(self, name: str, arguments) -> dict:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        call = {"id": self._new_id(), "type": "function", "function": {"name": name, "arguments": args}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call}

    def _json_calls(self, final: bool) -> dict:
        """`required`: complete items of the enforced array, each a call once it has closed."""
        entries = []
        decoder = json.JSONDecoder()
        while True:
            rest = self._text[self._done:]
            head = rest.lstrip(" \n[,")
            if not head or head.startswith("]"):
                break
            try:
                item, end = decoder.raw_decode(head)
            except ValueError:
                break
            self._done += len(rest) - len(head) + end
            if isinstance(item, dict) and isinstance(item.get("name"), str) and "arguments" in item:
                entries.append(self._add_call(item["name"], item["arguments"]))
        out = {"tool_calls": entries} if entries else {}
        if final and self._text[self._done:].strip(" \n],"):  # cut short (length): what is left stays text
            out.update(self._content(self._text[self._done:]))
        return out

    def _auto(self, final: bool) -> dict:
        """`auto`: text until a call begins (its marker, or for llama3_json and a bare mistral
        array the output's first character), then calls as each one closes."""
        content, entries = "", []
        while True:
            rest = self._text[self._done:]
            if self._tool_mode:
                got = self._next_call(rest)
                if got is None:  # the call has not closed yet
                    break
                used, calls, is_text = got
                entries += [self._add_call(*call) for call in calls]
                if is_text:  # not a call after all: the model's text
                    content += self._text[self._done:self._done + used]
                self._done += used
                continue
            start = self._call_start(rest)
            if start is None:  # cannot tell yet whether a call begins
                break
            if start >= 0:
                content += rest[:start].rstrip()  # whitespace before a call is dropped
                self._done += start
                self._tool_mode = True
                continue
            # held back: what could begin a marker, and the whitespace before it (a call drops it)
            piece = rest if final else rest[:len(rest) - (_holdback(rest, self._marker) if self._marker else 0)].rstrip()
            content += piece
            self._done += len(piece)
            break
        if final:
            left = self._text[self._done:]
            if left.strip() or (left and not self.calls and not entries):  # a call cut short stays text
                content += left
            self._done = len(self._text)
        out: dict = {}
        if content:
            self.content += content
            out["content"] = content
        if entries:
            out["tool_calls"] = entries
        return out

    @property
    def _marker(self) -> str | None:
        return {"hermes": HERMES_OPEN, "mistral": MISTRAL_MARK}.get(self.format)

    def _call_start(self, rest: str) -> int | None:
        """Where a call begins in `rest`: an index, -1 for nowhere, None when it cannot tell yet."""
        if self._marker is not None and (at := rest.find(self._marker)) >= 0:
            return at
        if self.format == "hermes" or self.content or self.calls:
            return -1  # llama3_json's and a bare mistral array's calls open the output
        head = rest.lstrip()
        if not head:
            return None
        return len(rest) - len(head) if head.startswith("{" if self.format == "llama3_json" else "[") else -1

    def _next_call(self, rest: str) -> tuple[int, list[tuple[str, object]], bool] | None:
        """The next piece of `rest` in tool mode: (characters used, the calls read from them,
        whether they are the model's text instead: a block that does not parse); None until it
        closes. Markers and separators between calls are dropped; where the calls end, so does
        tool mode."""
        head = rest.lstrip()
        if self.format == "hermes":
            if not head.startswith(HERMES_OPEN):
                if head and not HERMES_OPEN.startswith(head):
                    self._tool_mode = False  # text after the calls
                    return 0, [], False
                return None
            close = head.find(HERMES_CLOSE)
            if close < 0:
                return None
            call = _as_call(_json_or_none(head[len(HERMES_OPEN):close]), ("arguments", "parameters"))
            return len(rest) - len(head) + close + len(HERMES_CLOSE), [call] if call else [], call is None
        if self.format == "mistral":
            if head.startswith(MISTRAL_MARK):
                return len(rest) - len(head) + len(MISTRAL_MARK), [], False
            if not head or MISTRAL_MARK.startswith(head):
                return None  # the marker may be arriving
            opener = "["
        else:
            head = rest.lstrip(" \n;")
            opener = "{"
            if not head:
                return None
        if not head.startswith(opener):
            self._tool_mode = False
            return 0, [], False
        try:
            item, end = json.JSONDecoder().raw_decode(head)
        except ValueError:
            return None
        items = item if opener == "[" and isinstance(item, list) and item else [item]
        calls = [_as_call(x, ("arguments", "parameters") if opener == "[" else ("parameters", "arguments"))
                 for x in items]
        used = len(rest) - len(head) + end
        return (used, calls, False) if all(calls) else (used, [], True)


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _as_call(item, argument_keys: tuple[str, ...]) -> tuple[str, object] | None:
    """(name, arguments) of a parsed call object, or None where it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    for key in argument_keys:
        if key in item:
            return item["name"], item[key]
    return item["name"], {}
