"""A chat request's tools as the API takes them (`tools`, `tool_choice`, `parallel_tool_calls`,
validated together as a ToolSet), and the grammar that enforces `required` and named choices."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.structured_output import StructuredOutput

MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


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
    """A request's tools and how it asks them to be used (validated together):

    - `none`: the tools are rendered (the conversation may refer to them), the output is plain text.
    - a named function: the output is that function's arguments, enforced by its JSON schema.
    - `required`: the output is a JSON array of calls `[{"name", "arguments"}]` (one call unless
      `parallel`), each call's arguments enforced by its function's schema.
    - `auto`: the model writes text or calls in its family's format (tool_parsers/), read as they come.

    Enforced choices use the structured-output grammar, so they stay exact under speculation."""
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
