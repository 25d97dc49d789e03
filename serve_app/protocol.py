"""OpenAI-compatible request schemas (pydantic) and their conversion to SamplingParams.

Every field of OpenAI's completions and chat-completions request bodies either takes effect or is
refused with a 400 naming it: `NOT_SERVED` lists the fields accepted only at the value that asks
for nothing the server does not do (their default, or what it does anyway), and a field in neither
the schema nor that list is a 400 too (a misspelt `max_token` would otherwise change nothing).
Extensions beyond the OpenAI API: top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids and
spec_length (per-request cap on proposed tokens per round; 0 turns speculation off for it), and
guided_regex / guided_choice (structured outputs beside OpenAI's `response_format`, as in vLLM).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from serve_app.errors import APIError
from serve_app.tool_schemas import Tool, ToolCall, ToolChoice, ToolSet

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat allows 20; completions 5, vLLM 20)


def _absent(value) -> bool:
    return value in (None, [], {}, "")


def _implicit_cache(value) -> bool:
    return _absent(value) or (isinstance(value, dict) and set(value) <= {"mode", "ttl"}
                              and value.get("mode") in (None, "implicit") and value.get("ttl") in (None, "30m"))


# OpenAI fields the server does not serve: accepted only where the value asks for nothing it does
# not do; any other value is a 400 naming the field, with the reason
NOT_SERVED = {
    "functions": (_absent, "the legacy functions field is not served; use tools"),
    "function_call": (_absent, "the legacy function_call field is not served; use tool_choice"),
    "suffix": (_absent, "insertion (suffix) is not served"),
    "best_of": (lambda v: v in (None, 1), "best_of other than 1 is not served"),
    "audio": (_absent, "audio output is not served"),
    "modalities": (lambda v: v in (None, [], ["text"]), "only text output is served"),
    "prediction": (_absent, "predicted outputs are not served"),
    "store": (lambda v: v in (None, False), "storing completions is not served"),
    "metadata": (_absent, "metadata is kept with stored completions, and storing is not served"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "one service tier is served: auto or default"),
    "prompt_cache_retention": (lambda v: v in (None, "in_memory"),
                               "the prefix cache is kept in memory only: in_memory is served"),
    "prompt_cache_options": (_implicit_cache, "the prefix cache is implicit (every full KV block of a prompt): mode "
                                              "implicit and the default ttl are served"),
    "reasoning_effort": (_absent, "reasoning effort is not served"),
    "verbosity": (_absent, "verbosity is not served"),
    "web_search_options": (_absent, "web search is not served"),
    "moderation": (_absent, "moderation is not served"),
}


def refuse_unserved(data: dict, known: set[str]) -> None:
    """400 naming the first field that is neither in the schema (`known`) nor accepted by NOT_SERVED."""
    for name, value in data.items():
        if name in NOT_SERVED:
            accepted, why = NOT_SERVED[name]
            if not accepted(value):
                raise APIError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
        elif name not in known:
            raise APIError(400, f"{name}: unknown field (the fields served are listed in docs/reference/http.md)",
                           param=name, code="unknown_parameter")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False  # a last chunk with the usage and the speculation stats
    include_obfuscation: bool = False  # each chunk carries `obfuscation`, random characters that vary its size


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"  # a name for the schema (not used)
    description: str | None = None  # not used
    schema_: dict | None = Field(default=None, alias="schema")  # the JSON schema the output must follow
    strict: bool | None = None  # the grammar enforces every schema wholly; keywords it cannot are refused


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]  # text: no constraint
    json_schema: JSONSchemaFormat | None = None  # for type json_schema


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # the served name or the checkpoint path (optional)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # max_tokens by OpenAI's newer name (wins over it)
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: int = 1  # choices per request (each its own sample; the server's max_n caps it)
    stream: bool = False  # answer as server-sent events, then data: [DONE]
    stream_options: StreamOptions | None = None  # include_usage: one more chunk at the end with the usage
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    user: str | None = None  # the end user: with suffix_sharing "tenant", whose earlier answers may inform suffix proposals
    safety_identifier: str | None = None  # the end user, by OpenAI's newer name: as user (wins over it)
    prompt_cache_key: str | None = None  # requests sharing it share a suffix cache (suffix_sharing "tenant"; wins over both)
    service_tier: Literal["auto", "default"] | None = None  # one tier is served; the response says "default"
    # extensions
    top_k: Annotated[int, Field(ge=-1)] = -1  # keep the k most likely tokens; -1 or 0: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    spec_length: Annotated[int, Field(ge=0, le=64)] | None = None
    response_format: ResponseFormat | None = None  # text, json_object or json_schema (structured outputs)
    guided_regex: str | None = None  # the output matches this regular expression (as in vLLM)
    guided_choice: list[str] | None = None  # the output is one of these strings (as in vLLM)
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0  # subtracted once per occurrence in the output
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # token id -> added to its logit

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        if isinstance(data, dict):
            refuse_unserved(data, {f.alias or name for name, f in cls.model_fields.items()})
        return data

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v):
        if v is None:
            return v
        for key in v:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key!r}")
        return v

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int) -> int:
        if v < 1:
            raise ValueError("n must be >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            max_tokens=next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None),
                            default_max_tokens),
            stop=self.stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            seed=self.seed, spec_length=self.spec_length, structured_output=self.structured_output(),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            logprobs=self.token_logprobs, prompt_logprobs=self.prompt_logprobs,
            tenant=self.prompt_cache_key or self.safety_identifier or self.user or None,
        )

    @property
    def token_logprobs(self) -> int | None:
        """Top alternatives per output token's logprob (None: no logprobs)."""
        return None

    @property
    def prompt_logprobs(self) -> int | None:
        return None

    @property
    def structured_param(self) -> str | None:
        """The field that asks for structured output, if one does."""
        given = [name for name, on in (("response_format", self.response_format is not None
                                        and self.response_format.type != "text"),
                                       ("guided_regex", self.guided_regex is not None),
                                       ("guided_choice", self.guided_choice is not None)) if on]
        if len(given) > 1:
            raise APIError(400, f"at most one of {given} may be given", param=given[1], code="invalid_value")
        return given[0] if given else None

    @property
    def grammar_param(self) -> str | None:
        """The field an error in the grammar itself is reported against."""
        if self.structured_param == "response_format" and self.response_format.type == "json_schema":
            return "response_format.json_schema.schema"
        return self.structured_param

    def structured_output(self) -> StructuredOutput | None:
        param = self.structured_param
        try:
            if param == "guided_regex":
                return StructuredOutput("regex", self.guided_regex)
            if param == "guided_choice":
                return StructuredOutput.choice(self.guided_choice)
            if param is None or self.response_format.type == "json_object":
                return None if param is None else StructuredOutput("json_object")
            spec = self.response_format.json_schema
            if spec is None or spec.schema_ is None:
                param = "response_format.json_schema" + ("" if spec is None else ".schema")
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            param = "response_format.json_schema.schema"
            return StructuredOutput.json_schema(spec.schema_)
        except ValueError as exc:
            raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def obfuscate(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_obfuscation)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]  # text or token ids; one prompt per request
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: the prompt scored (echo with logprobs), nothing generated
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # each token's logprob and this many top alternatives
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's logprobs too)

    @model_validator(mode="after")
    def _echo(self):
        if self.max_tokens == 0 and not (self.echo and self.logprobs is not None):
            raise APIError(400, "max_tokens: 0 is only allowed with echo and logprobs (scoring the prompt)",
                           param="max_tokens", code="invalid_value")
        if self.echo and self.stream:
            raise APIError(400, "echo: not served with stream; use stream false to score a prompt", param="echo",
                           code="unsupported_parameter")
        return self

    @property
    def token_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo and self.logprobs is not None else None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("exactly one prompt per request is supported")
            v = v[0]
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]  # only text parts
    text: str  # the part's text
    prompt_cache_breakpoint: dict | None = None  # a caching hint: every full KV block of a prompt is cached anyway


ROLES = ("system", "user", "assistant", "developer", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]  # who wrote the message
    content: str | list[TextPart] | None = None  # a string, or text parts (joined)
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (as the server returned them)
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # the author's name, given to the chat template
    refusal: str | None = None  # an assistant's refusal (as returned): its content where it has none

    @staticmethod
    def refuse_unserved(i: int, message) -> None:
        """400 naming what of messages[i] is not served: another role, audio, function_call, a
        content part other than text (before the schema, so the answer says why)."""
        if not isinstance(message, dict):
            return
        if message.get("role") not in (*ROLES, None):
            raise APIError(400, f"messages[{i}].role: {message.get('role')!r} is not served (roles: "
                                f"{', '.join(ROLES)}; the legacy function role's answers go in tool messages)",
                           param=f"messages[{i}].role", code="unsupported_parameter")
        for name in ("audio", "function_call"):
            if not _absent(message.get(name)):
                raise APIError(400, f"messages[{i}].{name}: {NOT_SERVED[name][1]}", param=f"messages[{i}].{name}",
                               code="unsupported_parameter")
        parts = message.get("content")
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise APIError(400, f"messages[{i}].content[{j}]: only text content parts are served, got type "
                                    f"{kind!r}", param=f"messages[{i}].content[{j}]", code="unsupported_parameter")

    def for_template(self) -> dict:
        """The message as chat templates read it."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]  # the conversation, through the checkpoint's chat template
    logprobs: bool = False  # each output token's logprob (the target's, also under speculation)
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # this many top alternatives per token
    tools: list[Tool] | None = None  # functions the model may call (at most 128)
    tool_choice: ToolChoice | None = None  # none, auto (the default with tools), required, or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True  # required: more than one call allowed

    @model_validator(mode="before")
    @classmethod
    def _messages_served(cls, data):
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            for i, message in enumerate(data["messages"]):
                ChatMessage.refuse_unserved(i, message)
        return data

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs true", param="top_logprobs", code="invalid_value")
        return self

    @model_validator(mode="after")
    def _tools(self):
        try:
            tool_set = self.tool_set
        except ValueError as exc:
            raise APIError(400, f"tools: {exc}", param="tools", code="invalid_value") from None
        problem = tool_set.check()
        if problem is not None:
            raise APIError(400, f"{problem[0]}: {problem[1]}", param=problem[0], code="invalid_value")
        if tool_set.mode in ("required", "named") and super().structured_param is not None:
            raise APIError(400, f"tool_choice: {tool_set.mode!r} and {super().structured_param} both constrain the "
                                "output; give one", param="tool_choice", code="invalid_value")
        return self

    @property
    def tool_set(self) -> ToolSet:
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        return ToolSet(tools=self.tools or [], choice=choice, parallel=self.parallel_tool_calls)

    @property
    def structured_param(self) -> str | None:
        return "tool_choice" if self.tool_set.mode in ("required", "named") else super().structured_param

    @property
    def grammar_param(self) -> str | None:
        tool_set = self.tool_set
        if tool_set.mode == "named":
            return f"tools[{tool_set.index_of(tool_set.choice.function.name)}].function.parameters"
        return "tools" if tool_set.mode == "required" else super().grammar_param

    def structured_output(self) -> StructuredOutput | None:
        try:
            grammar = self.tool_set.grammar()
        except ValueError as exc:  # a schema too large to enforce
            raise APIError(400, f"{self.grammar_param}: {exc}", param=self.grammar_param, code="invalid_value") from None
        return grammar[0] if grammar is not None else super().structured_output()

    @property
    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
