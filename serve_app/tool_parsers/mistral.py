"""Mistral's tool calls: [TOOL_CALLS] and a JSON array of `{"name", "arguments"}`, the marker
optional where the array opens the output."""

from __future__ import annotations

from serve_app.tool_parsers.base import Piece, ToolParser

MISTRAL_MARK = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    template_marks = (MISTRAL_MARK,)
    marker = MISTRAL_MARK
    opener = "["

    def _next_call(self, rest: str) -> Piece | None:
        head = rest.lstrip()
        if head.startswith(MISTRAL_MARK):
            return len(rest) - len(head) + len(MISTRAL_MARK), [], False
        if not head or MISTRAL_MARK.startswith(head):
            return None  # the marker may be arriving
        return self._json_block(rest, head)
