"""Llama 3.1+'s JSON tool calls: the output opens with `{"name", "parameters"}` objects, one a
call, separated by whitespace or `;`."""

from __future__ import annotations

from serve_app.tool_parsers.base import Piece, ToolParser


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    template_marks = ("<|python_tag|>", "ipython")
    opener = "{"
    argument_keys = ("parameters", "arguments")

    def _next_call(self, rest: str) -> Piece | None:
        head = rest.lstrip(" \n;")
        if not head:
            return None
        return self._json_block(rest, head)
