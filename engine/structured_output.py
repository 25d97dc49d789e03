"""What a request's output must follow (`response_format` and its kin): a JSON object, a JSON
schema, a regex or a choice list, validated at the edge. engine/grammar.py compiles and enforces it.

A schema may use only the keywords the grammar enforces (`SCHEMA_KEYWORDS`) besides annotations:
a keyword it would ignore (`not`, `oneOf`, `multipleOf`, ...) could let an output through that does
not validate, so it is refused, naming where it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

GrammarKind = Literal["json_object", "json_schema", "regex", "choice"]
MAX_GRAMMAR_CHARS = 65536  # a schema's JSON, a regex or a choice list's JSON at most this long
SCHEMA_KEYWORDS = frozenset((
    "type", "enum", "const", "anyOf", "$ref", "$defs", "definitions",  # any instance
    "properties", "required", "additionalProperties", "minProperties", "maxProperties",  # objects
    "items", "prefixItems", "minItems", "maxItems",  # arrays
    "minLength", "maxLength", "pattern", "format",  # strings
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",  # numbers
))
ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly"))
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keywords whose values map names to schemas
_SCHEMA_LISTS = ("anyOf", "prefixItems")  # ... that hold lists of schemas
_SCHEMAS = ("items", "additionalProperties")  # ... that hold one schema


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
        """A schema checked against the JSON Schema meta-schema and `SCHEMA_KEYWORDS`."""
        import jsonschema

        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"invalid JSON schema: {exc.message}") from None
        unsupported = _unsupported_keywords(schema, "#")
        if unsupported:
            raise ValueError(f"unsupported JSON schema keyword(s) {unsupported}; supported: "
                             f"{sorted(SCHEMA_KEYWORDS)} and annotations")
        return cls("json_schema", json.dumps(schema))  # key order kept: properties are generated in it

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {choices!r}")
        return cls("choice", json.dumps(choices))


def _unsupported_keywords(schema, path: str) -> list[str]:
    """Paths ("#/properties/a/not") of the keywords outside SCHEMA_KEYWORDS and ANNOTATIONS."""
    if not isinstance(schema, dict):
        return []
    out = [f"{path}/{k}" for k in schema if k not in SCHEMA_KEYWORDS and k not in ANNOTATIONS]
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            out += _unsupported_keywords(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            out += _unsupported_keywords(sub, f"{path}/{key}/{i}")
    for key in _SCHEMAS:
        out += _unsupported_keywords(schema.get(key), f"{path}/{key}")
    return out
