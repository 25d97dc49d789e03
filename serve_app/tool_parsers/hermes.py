"""Hermes' tool calls (Qwen2.5/3, NousResearch, and the generic prompt for templates that render
no tools): each call a JSON object `{"name", "arguments"}` between <tool_call> and </tool_call>."""

from __future__ import annotations

from serve_app.tool_parsers.base import Piece, ToolParser, as_call, json_or_none

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    template_marks = (HERMES_OPEN,)
    marker = HERMES_OPEN

    def _next_call(self, rest: str) -> Piece | None:
        head = rest.lstrip()
        if not head.startswith(HERMES_OPEN):
            if head and not HERMES_OPEN.startswith(head):
                return self._end_calls()  # text after the calls
            return None
        close = head.find(HERMES_CLOSE)
        if close < 0:
            return None
        call = as_call(json_or_none(head[len(HERMES_OPEN):close]), self.argument_keys)
        return len(rest) - len(head) + close + len(HERMES_CLOSE), [call] if call else [], call is None
