"""ToolParser, the base of every tool-call format's parser: the modes every format shares and,
for `auto`, the split of text from calls; a format's module says where its calls begin and how."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from serve_app.tool_schemas import ToolSet

# a piece of the text in tool mode: (characters used, the (name, arguments) calls read from them,
# whether those characters are the model's text instead: a block that does not parse)
Piece = tuple[int, list[tuple[str, object]], bool]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def holdback(text: str, marker: str) -> int:
    """Characters at the end of `text` that could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def as_call(item, argument_keys: tuple[str, ...]) -> tuple[str, object] | None:
    """(name, arguments) of a parsed call object, or None where it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    for key in argument_keys:
        if key in item:
            return item["name"], item[key]
    return item["name"], {}


class ToolParser(ABC):
    """One choice's output text, fed as it arrives, as OpenAI message deltas: `{"content": ...}`
    and/or `{"tool_calls": [...]}` (a call's first entry carries its id, type and name). Streamed
    deltas concatenate to the whole-text result (`content`, `calls`); a call that does not parse
    stays text, so nothing the model wrote is lost."""

    name: ClassVar[str]  # the format's name, as tool_call_format takes it
    template_marks: ClassVar[tuple[str, ...]]  # any of them in a chat template: its family writes this format
    marker: ClassVar[str | None] = None  # the text that opens a call, where the format has one
    opener: ClassVar[str | None] = None  # what a call without its marker opens with, at the output's start only
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")  # where a call's arguments are, first found

    def __init__(self, tools: ToolSet, new_id: Callable[[], str] = new_call_id):
        self.mode = tools.mode
        self.named = tools.choice.function.name if self.mode == "named" else None
        self._new_id = new_id
        self._text = ""  # everything fed
        self._done = 0  # characters of _text already turned into deltas
        self.content = ""
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}
        self._tool_mode = False  # auto: the output has begun a call

    # --- a format's own part -----------------------------------------------------------
    @abstractmethod
    def _next_call(self, rest: str) -> Piece | None:
        """The next piece of `rest` in tool mode; None until it closes. Markers and separators
        between calls are dropped; where the calls end, so does tool mode (`_end_calls`)."""

    # --- the whole and streamed results --------------------------------------------------
    def delta(self, text: str, last: bool) -> dict:
        """A streamed chunk's delta: `text` read, and on the choice's last chunk what is left."""
        delta = self.feed(text)
        if last:
            rest = self.finish()
            if "content" in rest:
                delta["content"] = delta.get("content", "") + rest["content"]
            if "tool_calls" in rest:
                delta["tool_calls"] = delta.get("tool_calls", []) + rest["tool_calls"]
        return delta

    def message(self, text: str) -> dict:
        """The assistant message of the whole output `text`."""
        self.feed(text)
        self.finish()
        if self.calls:
            return {"role": "assistant", "content": self.content or None, "tool_calls": self.calls}
        return {"role": "assistant", "content": self.content}

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish reason: `tool_calls` where it stopped having called."""
        return "tool_calls" if reason == "stop" and self.calls else reason

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
        """`auto`: text until a call begins (its marker, or where the format has an opener the
        output's first character), then calls as each one closes."""
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
            piece = rest if final else rest[:len(rest) - (holdback(rest, self.marker) if self.marker else 0)].rstrip()
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

    def _call_start(self, rest: str) -> int | None:
        """Where a call begins in `rest`: an index, -1 for nowhere, None when it cannot tell yet."""
        if self.marker is not None and (at := rest.find(self.marker)) >= 0:
            return at
        if self.opener is None or self.content or self.calls:
            return -1  # a call without its marker opens the output
        head = rest.lstrip()
        if not head:
            return None
        return len(rest) - len(head) if head.startswith(self.opener) else -1

    def _end_calls(self) -> Piece:
        """Text after the calls: tool mode ends, nothing used."""
        self._tool_mode = False
        return 0, [], False

    def _json_block(self, rest: str, head: str) -> Piece | None:
        """For formats whose calls are bare JSON: the value `head` (the end of `rest`) opens with,
        an object or a list of them, read as calls; the calls' end where it opens otherwise."""
        if not head.startswith(self.opener):
            return self._end_calls()
        try:
            item, end = json.JSONDecoder().raw_decode(head)
        except ValueError:
            return None
        items = item if isinstance(item, list) and item else [item]
        calls = [as_call(x, self.argument_keys) for x in items]
        used = len(rest) - len(head) + end
        return (used, calls, False) if all(calls) else (used, [], True)
