"""Tool calls: reading calls out of the model's text in each family's format (whole and streamed
in any cut), the grammars of required and named choices, and the prompts tools render into."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from engine.grammar import GrammarCompiler
from engine.tokenizer import Tokenizer
from serve_app.errors import APIError
from serve_app.protocol import ChatCompletionRequest
from serve_app.tool_parsers import PARSERS, ToolParser, format_of_template, parser_for, register_parser
from serve_app.tool_parsers.hermes import HermesParser
from serve_app.tool_parsers.llama3_json import Llama3JsonParser
from serve_app.tool_parsers.mistral import MistralParser
from serve_app.tool_rendering import render_messages
from serve_app.tool_schemas import Tool, ToolSet
from tests.helpers import REPO

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]


@pytest.fixture(scope="module")
def target_dir() -> Path:
    """The shipped target's tokenizer: its chat template renders no tools."""
    return REPO / "models" / "target"


def _reader(choice, fmt: str) -> ToolParser:
    ids = itertools.count()
    return parser_for(fmt)(ToolSet(tools=TOOLS, choice=choice), new_id=lambda: f"call_{next(ids)}")


def _read(choice, fmt: str, text: str, cuts: list[int]) -> tuple[ToolParser, list[dict]]:
    reader, deltas, start = _reader(choice, fmt), [], 0
    for cut in [*cuts, len(text)]:
        deltas.append(reader.feed(text[start:cut]))
        start = cut
    deltas.append(reader.finish())
    return reader, deltas


def _reassemble(deltas: list[dict]) -> tuple[str, list[tuple[str, str, str]]]:
    """What an OpenAI client builds from streamed deltas: the content, and (id, name, arguments)
    per call index."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for entry in d.get("tool_calls", []):
            call = calls.setdefault(entry["index"], ["", "", ""])
            call[0] += entry.get("id", "")
            call[1] += entry.get("function", {}).get("name", "")
            call[2] += entry.get("function", {}).get("arguments", "")
    return content, [tuple(c) for _, c in sorted(calls.items())]


NAMED = {"type": "function", "function": {"name": "get_weather"}}
CASES = [  # (tool_choice, format, the model's text, expected content, expected [(name, arguments)])
    ("auto", "hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("auto", "hermes", "a < b, and <tool_c is not a call", "a < b, and <tool_c is not a call", []),
    ("auto", "hermes", '<tool_call>{"name": broken}</tool_call> then text',
     '<tool_call>{"name": broken}</tool_call> then text', []),
    ("auto", "hermes", '<tool_call>{"name": "get_time", "arguments": {}}', '<tool_call>{"name": "get_time", "arguments": {}}',
     []),  # cut short before its close: the text is kept
    ("auto", "llama3_json", ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; '
     '{"name": "get_time", "parameters": {}}', "", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    ("auto", "llama3_json", 'It is {"name": "x"} in JSON', 'It is {"name": "x"} in JSON', []),
    ("auto", "llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("auto", "mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, '
     '{"name": "get_weather", "arguments": {"city": "Lyon"}}]', "",
     [("get_weather", '{"city": "Nice"}'), ("get_weather", '{"city": "Lyon"}')]),
    ("auto", "mistral", '[{"name": "get_time", "arguments": {}}]', "", [("get_time", "{}")]),  # the marker decoded away
    ("auto", "mistral", "[1, 2] is a list", "[1, 2] is a list", []),
    ("none", "hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', []),
    ("required", "hermes", '[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_time","arguments":{}}]',
     "", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("required", "hermes", '[{"name":"get_weather","arguments":{"ci', '[{"name":"get_weather","arguments":{"ci', []),
    (NAMED, "hermes", '{"city":"Paris"}', "", [("get_weather", '{"city":"Paris"}')]),
]


@pytest.mark.parametrize("choice,fmt,text,content,calls", CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_calls_read_whole_and_streamed_in_any_cut_agree(choice, fmt, text, content, calls):
    whole, deltas = _read(choice, fmt, text, [])
    assert whole.content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls] == calls
    assert _reassemble(deltas) == (content, [(c["id"], c["function"]["name"], c["function"]["arguments"])
                                             for c in whole.calls])
    rng = random.Random(0)
    for _ in range(150):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(1, min(10, len(text)))))
        streamed, deltas = _read(choice, fmt, text, cuts)
        assert (streamed.content, streamed.calls) == (whole.content, whole.calls), cuts
        assert _reassemble(deltas) == _reassemble(_read(choice, fmt, text, [])[1]), cuts


def test_a_call_streams_its_id_and_name_once_then_argument_pieces():
    _, deltas = _read(NAMED, "hermes", '{"city":"Rome"}', [3, 9])
    entries = [e for d in deltas for e in d.get("tool_calls", [])]
    assert entries[0] == {"index": 0, "id": "call_0", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"c'}}
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in entries[1:])


def _grammar_accepts(compiler: GrammarCompiler, tok: Tokenizer, choice, text: str, parallel: bool = True) -> bool:
    spec, _ = ToolSet(tools=TOOLS, choice=choice, parallel=parallel).grammar()
    matcher = compiler.matcher(spec)
    ids = tok.hf.encode(text, add_special_tokens=False)
    return all(matcher.commit(t) for t in ids) and matcher._matcher.is_accepting()


def test_required_and_named_grammars_enforce_the_functions_schemas(target_dir):
    tok = Tokenizer(target_dir)
    compiler = GrammarCompiler(tok, tok.vocab_size)
    assert _grammar_accepts(compiler, tok, NAMED, '{"city":"Paris"}')
    assert not _grammar_accepts(compiler, tok, NAMED, '{"town":"Paris"}')  # not a parameter
    assert not _grammar_accepts(compiler, tok, NAMED, '{}')  # city is required
    assert _grammar_accepts(compiler, tok, "required", '[{"name":"get_time","arguments":{}}]')
    two = '[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"Oslo"}}]'
    assert _grammar_accepts(compiler, tok, "required", two)
    assert not _grammar_accepts(compiler, tok, "required", two, parallel=False)
    assert not _grammar_accepts(compiler, tok, "required", '[{"name":"get_date","arguments":{}}]')
    assert not _grammar_accepts(compiler, tok, "required", "[]")  # at least one call
    assert not _grammar_accepts(compiler, tok, "required", '[{"name":"get_weather","arguments":{"city":3}}]')


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
])
def test_inconsistent_tool_requests_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as err:
        _chat(**fields)
    assert err.value.status == 400 and err.value.param == param


def test_bad_tool_fields_are_refused_by_validation():
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="function names"):
        _chat(tools=[{"type": "function", "function": {"name": "has space"}}])
    with pytest.raises(ValidationError):
        _chat(tools=[WEATHER], tool_choice="sometimes")


def test_tool_choice_defaults_to_auto_with_tools_and_the_grammar_names_its_schema():
    assert _chat(tools=[WEATHER]).tool_set.mode == "auto"
    assert _chat().tool_set.mode == "none"
    named = _chat(tools=[TIME, WEATHER], tool_choice=NAMED)
    assert named.structured_output().kind == "json_schema" and named.grammar_param == "tools[1].function.parameters"
    assert _chat(tools=[WEATHER], tool_choice="required").grammar_param == "tools"


def test_formats_are_read_off_the_chat_template():
    assert format_of_template(None) == ("hermes", False)
    assert format_of_template("{% for m in messages %}{{ m['content'] }}{% endfor %}") == ("hermes", False)
    assert format_of_template("{% if tools %}<tool_call>{% endif %}") == ("hermes", True)
    assert format_of_template("{% if tools %}<|python_tag|>{% endif %}") == ("llama3_json", True)
    assert format_of_template("{% if tools %}[TOOL_CALLS]{% endif %}") == ("mistral", True)


def test_every_format_has_its_parser_and_an_unknown_one_names_them():
    expected = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
    assert PARSERS == expected and all(parser_for(name) is p and p.name == name for name, p in expected.items())
    with pytest.raises(ValueError, match=r"one of \['hermes', 'llama3_json', 'mistral'\], got 'xml'"):
        parser_for("xml")
    with pytest.raises(ValueError, match="'hermes' is already registered"):
        register_parser(HermesParser)


def test_a_format_registered_from_a_test_is_found_by_name_and_template():
    class Bracketed(HermesParser):
        name, template_marks = "bracketed_test", ("<<call>>",)
    register_parser(Bracketed)
    try:
        assert parser_for("bracketed_test") is Bracketed
        assert format_of_template("{% if tools %}<<call>>{% endif %}") == ("bracketed_test", True)
    finally:
        del PARSERS["bracketed_test"]


CALLED = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
ANSWERED = {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_a_template_without_tools_gets_them_in_a_system_message(target_dir):
    messages, tools = render_messages([{"role": "user", "content": "weather?"}, CALLED, ANSWERED], TOOLS, False)
    assert tools is None and messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in messages[2]["content"]
    assert "tool_call_id" not in messages[3]
    prompt = Tokenizer(target_dir).hf.decode(Tokenizer(target_dir).apply_chat_template(messages, tools))
    assert "get_weather" in prompt and "sunny" in prompt
    with_system, _ = render_messages([{"role": "system", "content": "Be brief."}], TOOLS, False)
    assert len(with_system) == 1 and with_system[0]["content"].startswith("Be brief.\n\n")


QWEN_LIKE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
             "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
             "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_a_template_that_renders_tools_gets_them_and_the_calls_arguments_as_objects(target_dir):
    tok = Tokenizer(target_dir)
    tok.hf.chat_template = QWEN_LIKE
    fmt, renders = format_of_template(tok.hf.chat_template)
    assert (fmt, renders) == ("hermes", True)
    messages, tools = render_messages([{"role": "user", "content": "weather?"}, CALLED, ANSWERED], TOOLS, renders)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    prompt = tok.hf.decode(tok.apply_chat_template(messages, tools))
    assert "<tools>get_weather;get_time;</tools>" in prompt
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in prompt and "[tool]sunny" in prompt


def test_lone_surrogates_in_tools_name_their_path(target_dir):
    bad = {"type": "function", "function": {"name": "f", "description": "\udfff"}}
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.description"):
        Tokenizer(target_dir).apply_chat_template([{"role": "user", "content": "x"}], [bad])
