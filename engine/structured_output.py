"""What a request's output must follow (`response_format` and its kin): a JSON object, a JSON
schema, a regex or a choice list, checked for shape and size here; engine/grammar.py compiles and
enforces it (refusing what it cannot enforce).

An object schema with `properties` and no `additionalProperties` is closed (as in OpenAI's strict
mode and xgrammar's default): otherwise a small model pads a document with invented keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

GrammarKind = Literal["json_object", "json_schema", "regex", "choice"]
MAX_GRAMMAR_CHARS = 65536  # a schema's JSON, a regex or a choice list's JSON at most this long


@dataclass(frozen=True)
class StructuredOutput:
    """kind "json_object" (value None), "json_schema" (the schema as JSON text), "regex" (the
    pattern) or "choice" (a JSON list of the allowed strings)."""

    kind: GrammarKind
    value: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in get_args(GrammarKind):
            raise ValueError(f"structured_output.kind must be one of {list(get_args(GrammarKind))}, got {self.kind!r}")
        if (self.value is None) != (self.kind == "json_object") or not isinstance(self.value, (str, type(None))):
            raise ValueError(f"structured_output.value: {self.kind} needs "
                             f"{'no value' if self.kind == 'json_object' else 'a string'}, got {self.value!r}")
        if self.value is not None and not 0 < len(self.value) <= MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_output.value: a {self.kind} of {len(self.value)} characters; "
                             f"1 to {MAX_GRAMMAR_CHARS} are supported")

    @classmethod
    def json_schema(cls, schema: dict) -> StructuredOutput:
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(closed(schema)))  # key order kept: properties come in it

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {choices!r}")
        return cls("choice", json.dumps(choices))


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")  # name -> schema
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed(schema):
    """A copy of `schema` in which every object with `properties` and no `additionalProperties`
    (nor `patternProperties`) takes no other keys."""
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in ("items", "additionalProperties", "not") else v for k, v in schema.items()}
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
