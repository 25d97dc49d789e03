"""The tool-call formats a model family writes, one parser class per format (base.py holds what
they share), found by name (`parser_for`) or off a chat template (`format_of_template`)."""

from __future__ import annotations

from serve_app.tool_parsers.base import ToolParser
from serve_app.tool_parsers.hermes import HermesParser
from serve_app.tool_parsers.llama3_json import Llama3JsonParser
from serve_app.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {}  # format name -> its parser, in the order templates are matched
DEFAULT_FORMAT = "hermes"  # a template that shows no format's marks (the generic tools prompt asks for it)


def register_parser(parser: type[ToolParser]) -> type[ToolParser]:
    """Adds a format (usable as a class decorator); its name must be new."""
    if parser.name in PARSERS:
        raise ValueError(f"a tool-call format named {parser.name!r} is already registered")
    PARSERS[parser.name] = parser
    return parser


def parser_for(name: str) -> type[ToolParser]:
    """The parser of the format `name` (ValueError naming the known ones)."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_format must be 'auto' or one of {sorted(PARSERS)}, got {name!r}")
    return PARSERS[name]


def format_of_template(chat_template: str | None) -> tuple[str, bool]:
    """The family's call format read off its chat template, and whether the template renders tools."""
    template = chat_template or ""
    found = next((name for name, p in PARSERS.items() if any(m in template for m in p.template_marks)), DEFAULT_FORMAT)
    return found, "tools" in template


register_parser(MistralParser)  # templates are matched in this order
register_parser(HermesParser)
register_parser(Llama3JsonParser)
