"""Structured outputs: grammars enforced exactly, with speculation on or off.

- Every constrained output of the shipped pair parses and validates against its schema, for each
  proposer (none, draft, n-gram, hybrid), greedy and sampled.
- Greedy constrained output with speculation equals greedy constrained output without (float32).
- Sampled constrained output follows the target's distribution masked by the grammar and
  renormalised at each step (chi-square against exact enumeration, speculation on and off).
- Bad grammars are ValueErrors naming the field; a bad request never disturbs the others.
"""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
import torch
from scipy.stats import chisquare

from engine import LLM, SamplingParams
from engine.grammar import GrammarCompiler, GrammarError, cut_proposals
from engine.structured_output import StructuredOutput
from engine.tokenizer import Tokenizer
from serve_app.errors import APIError
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from tests.exactness import CHOICES, N, exact_grammar_outcomes

SCHEMAS = {
    "nested_object": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                      "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "array_of_enums": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}},
        "required": ["tags"]},
    "numbers_and_optional": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "n": {"type": "integer", "minimum": 0, "maximum": 50},
        "ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 6}},
        "required": ["x", "ok"]},
    "array_of_objects": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9}, "kind": {"const": "item"}},
        "required": ["id", "kind"]}, "minItems": 1, "maxItems": 3},
}
PROMPTS = ["def config():\n    return ", "# the result as JSON\nresult = "]
METHODS = [None, "draft", "ngram", "hybrid"]


@pytest.fixture(scope="module")
def shipped():
    """The embedded target with its draft model in float32 (exact), speculation switched per test."""
    return LLM(dtype="float32", speculative_method="draft", spec_policy="fixed", spec_length=4, max_batch_size=16)


def _use(llm: LLM, method: str | None) -> None:
    if method is None:
        llm.engine.reconfigure_speculation(use_speculative_decoding=False)
    else:
        llm.engine.reconfigure_speculation(use_speculative_decoding=True, speculative_method=method)


@pytest.mark.parametrize("method", METHODS)
def test_every_output_validates_against_its_schema(shipped, method):
    _use(shipped, method)
    params, schemas = [], []
    for schema in SCHEMAS.values():
        for temperature in (0.0, 0.8):
            params.append(SamplingParams(temperature=temperature, max_tokens=160, seed=3,
                                         structured_output=StructuredOutput.json_schema(schema)))
            schemas.append(schema)
    outs = shipped.generate(PROMPTS * len(params), [p for p in params for _ in PROMPTS])
    for out, schema in zip(outs, [s for s in schemas for _ in PROMPTS]):
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    if method is not None:
        assert sum(o.num_draft_tokens for o in outs) > 0  # speculation ran under the grammar


def test_greedy_constrained_output_is_the_same_with_and_without_speculation(shipped):
    grammars = [StructuredOutput.json_schema(s) for s in SCHEMAS.values()] + [
        StructuredOutput("json_object"), StructuredOutput("regex", r"[a-z]{2,12}@[a-z]{2,8}\.(com|org)"),
        StructuredOutput.choice(["return None", "return self", "pass"])]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_output=g) for g in grammars]
    runs = {}
    for method in METHODS:
        _use(shipped, method)
        runs[method] = [o.token_ids for o in shipped.generate(PROMPTS * len(params), [p for p in params for _ in PROMPTS])]
    for method in METHODS[1:]:
        assert runs[method] == runs[None], method


def test_choice_and_regex_outputs_match_exactly(shipped):
    _use(shipped, "hybrid")
    choices = ["alpha", "beta", "gamma delta"]
    outs = shipped.generate(PROMPTS, SamplingParams(temperature=1.0, seed=5, max_tokens=20,
                                                    structured_output=StructuredOutput.choice(choices)))
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs)
    import re

    outs = shipped.generate(PROMPTS, SamplingParams(temperature=0.7, seed=2, max_tokens=40,
                                                    structured_output=StructuredOutput("regex", r"v[0-9]\.[0-9]{1,2}")))
    assert all(re.fullmatch(r"v[0-9]\.[0-9]{1,2}", o.text) and o.finish_reason == "stop" for o in outs)


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(shipped):
    _use(shipped, "draft")
    out = shipped.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, structured_output=StructuredOutput(
        "json_schema", json.dumps(SCHEMAS["nested_object"]))))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_mixed_constrained_and_unconstrained_requests_do_not_leak_into_each_other(shipped):
    """A batch mixing every schema, a regex and unconstrained requests, adaptive speculation:
    each constrained output validates against its own schema, and the unconstrained ones equal
    what they give alone."""
    shipped.engine.reconfigure_speculation(use_speculative_decoding=True, speculative_method="hybrid",
                                           spec_policy="adaptive")
    try:
        free = SamplingParams(temperature=0.0, max_tokens=40)
        alone = [o.token_ids for o in shipped.generate(PROMPTS, free)]
        params, expect = [], []
        for i, schema in enumerate(SCHEMAS.values()):
            params += [SamplingParams(temperature=0.9, seed=i, max_tokens=160,
                                      structured_output=StructuredOutput.json_schema(schema)), free]
            expect += [schema, None]
        outs = shipped.generate([PROMPTS[i % 2] for i in range(len(params))], params)
        for i, (out, schema) in enumerate(zip(outs, expect)):
            if schema is None:
                assert out.token_ids == alone[i % 2]
            else:
                assert out.finish_reason == "stop"
                jsonschema.validate(json.loads(out.text), schema)
    finally:
        shipped.engine.reconfigure_speculation(spec_policy="fixed")


# --- exact distribution under a grammar --------------------------------------------------

@pytest.mark.parametrize("speculate", [True, False])
def test_sampled_constrained_tokens_follow_the_masked_target_distribution(tiny_model, tiny_draft, tok_dir, speculate):
    (tpath, hf), (dpath, _) = tiny_model, tiny_draft
    spec = StructuredOutput.choice(CHOICES)
    prompt = [5, 17, 9, 30]
    expected = exact_grammar_outcomes(hf, tok_dir, prompt, spec, depth=4)
    kwargs = dict(draft_model=str(dpath), use_speculative_decoding=True, spec_length=2, spec_policy="fixed") \
        if speculate else {}
    llm = LLM(model=str(tpath), dtype="float32", max_batch_size=64, seed=7, **kwargs)
    outs = llm.generate([prompt] * N, SamplingParams(temperature=1.0, max_tokens=4, structured_output=spec))
    seen = Counter(tuple(o.token_ids) for o in outs)
    assert set(seen) <= set(expected)  # nothing outside the grammar
    if speculate:
        assert sum(o.num_draft_tokens for o in outs) > N  # rounds were verified, not plain steps
    keys = sorted(expected, key=expected.get, reverse=True)
    big = [k for k in keys if expected[k] * N >= 5]
    f_exp = [expected[k] * N for k in big] + [N * (1 - sum(expected[k] for k in big))]
    f_obs = [seen[k] for k in big] + [N - sum(seen[k] for k in big)]
    if f_exp[-1] < 5:  # the rare outcomes together are too few for their own bin
        f_exp, f_obs = f_exp[:-2] + [f_exp[-2] + f_exp[-1]], f_obs[:-2] + [f_obs[-2] + f_obs[-1]]
    assert len(big) >= 3
    assert chisquare(f_obs, f_exp).pvalue > 1e-3, (f_obs, f_exp)


# --- validation and isolation ------------------------------------------------------------

def test_cut_proposals_stop_at_the_first_forbidden_token(tok_dir):
    tokenizer = Tokenizer(tok_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer.hf))
    matcher = compiler.matcher(StructuredOutput.choice(["ab"]))
    a, b = (tokenizer.hf.convert_tokens_to_ids(c) for c in "ab")
    (cut_a, cut_free, cut_bad), masks = cut_proposals([matcher, None, compiler.matcher(StructuredOutput.choice(["ab"]))],
                                                      [[a, b, a], [b, b], [b]], len(tokenizer.hf))
    assert (cut_a, cut_free, cut_bad) == ([a, b], [b, b], [])
    assert masks.shape == (3, 3, len(tokenizer.hf))
    assert masks[0, 0].nonzero().flatten().tolist() == [a] and masks[0, 1].nonzero().flatten().tolist() == [b]
    assert masks[0, 2].nonzero().flatten().tolist() == sorted(tokenizer.eos_token_ids)  # complete: only EOS
    assert masks[1].all()
    assert matcher.allowed().nonzero().flatten().tolist() == [a]  # the walk was rolled back


def test_a_walk_through_the_end_of_a_document_and_its_eos_rolls_back_cleanly(tok_dir):
    """The verify pass may walk a proposal past a complete document and its EOS; rolling back must
    leave the committed state exactly as it was (llguidance keeps no state for the EOS)."""
    tokenizer = Tokenizer(tok_dir)
    matcher = GrammarCompiler(tokenizer, len(tokenizer.hf)).matcher(StructuredOutput.choice(["ab"]))
    a, b = (tokenizer.hf.convert_tokens_to_ids(c) for c in "ab")
    eos = min(tokenizer.eos_token_ids)
    (cut,), masks = cut_proposals([matcher], [[a, b, eos, a]], len(tokenizer.hf))
    assert cut == [a, b, eos] and masks[0, 3].all()  # after the EOS: anything (it is dropped)
    assert matcher.commit(a) and matcher.commit(b) and matcher.commit(eos)


def test_objects_with_properties_are_closed_unless_the_schema_says_otherwise():
    from engine.structured_output import closed

    inner = {"type": "object", "properties": {"b": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": inner, "c": {"type": "array", "items": inner}},
              "$defs": {"d": inner}, "anyOf": [inner]}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False and out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left alone
    assert closed({**inner, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in closed({"type": "object"})  # json_object stays open


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "array", "items": {"type": "number"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "made-up"}, "made-up"),
    ({"type": "foo"}, "foo"),
    ({"$ref": "#/$defs/missing"}, "missing"),
])
def test_schemas_the_grammar_cannot_enforce_are_refused_naming_what(tok_dir, schema, fragment):
    """A keyword the grammar would ignore could let an output through that does not validate."""
    tokenizer = Tokenizer(tok_dir)
    with pytest.raises(GrammarError, match="json_schema") as err:
        GrammarCompiler(tokenizer, len(tokenizer.hf)).matcher(StructuredOutput.json_schema(schema))
    assert fragment in str(err.value)


def test_bad_structured_outputs_are_value_errors():
    with pytest.raises(ValueError, match="characters"):
        StructuredOutput("regex", "a" * 70000)
    with pytest.raises(ValueError, match="choice"):
        StructuredOutput.choice([])
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("yaml", "x")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput("json_object"))


def test_a_grammar_that_does_not_compile_is_refused_and_others_run_on(tiny_model):
    llm = LLM(model=str(tiny_model[0]), dtype="float32")
    good = llm.engine.add_request([5, 6], SamplingParams(temperature=0.0, max_tokens=4,
                                                          structured_output=StructuredOutput("regex", "[ab]+")))
    with pytest.raises(GrammarError, match="regex"):
        llm.engine.add_request([5, 6], SamplingParams(structured_output=StructuredOutput("regex", "((")))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    out = llm.engine.get_output(good)
    assert out.finish_reason in ("stop", "length") and set(out.text) <= {"a", "b"} and out.text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["x" * 70000]}}}},
     "response_format.json_schema.schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_api_structured_output_errors_name_the_field(body, param):
    req = CompletionRequest.model_validate({"prompt": "x", **body})
    with pytest.raises(APIError) as err:
        req.sampling_params(16)
    assert err.value.status == 400 and err.value.param == param


def test_api_response_formats_become_structured_outputs():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    so = ChatCompletionRequest.model_validate({**chat, "response_format": fmt}).sampling_params(16).structured_output
    assert so.kind == "json_schema" and json.loads(so.value) == {**schema, "additionalProperties": False}
    so = ChatCompletionRequest.model_validate({**chat, "response_format": {"type": "json_object"}}).sampling_params(16)
    assert so.structured_output == StructuredOutput("json_object")
    assert ChatCompletionRequest.model_validate({**chat, "response_format": {"type": "text"}}) \
        .sampling_params(16).structured_output is None
    assert CompletionRequest.model_validate({"prompt": "x", "guided_regex": "[0-9]+"}).sampling_params(16) \
        .structured_output == StructuredOutput("regex", "[0-9]+")


def test_the_statistical_test_has_teeth_without_the_verify_mask(tiny_model, tiny_draft, tok_dir, monkeypatch):
    """With the verify pass unmasked (proposals still cut and drafted under the grammar), recovered
    and bonus tokens come from the unrestricted target: the outputs leave the grammar."""
    import engine.speculative.step as step_module

    monkeypatch.setattr(step_module, "mask_logits", lambda logits, masks: logits)
    (tpath, _), (dpath, _) = tiny_model, tiny_draft
    llm = LLM(model=str(tpath), dtype="float32", max_batch_size=64, seed=7, draft_model=str(dpath),
              use_speculative_decoding=True, spec_length=2, spec_policy="fixed")
    outs = llm.generate([[5, 17, 9, 30]] * 300, SamplingParams(temperature=1.0, max_tokens=4,
                                                              structured_output=StructuredOutput.choice(CHOICES)))
    assert sum(o.finish_reason == "error" for o in outs) > 10


def test_special_tokens_are_never_text_inside_a_string(tok_dir):
    """Inside a JSON string almost any token is text, but not BOS, PAD or EOS (xgrammar 0.2.8
    would allow BOS and PAD there with a tokenizer like the shipped one's)."""
    tokenizer = Tokenizer(tok_dir)
    matcher = GrammarCompiler(tokenizer, len(tokenizer.hf)).matcher(StructuredOutput.json_schema({"type": "string"}))
    assert matcher.commit(tokenizer.hf.convert_tokens_to_ids('"'))
    allowed = matcher.allowed()
    assert allowed.sum() > len(tokenizer.hf) // 2
    assert not any(allowed[tokenizer.hf.convert_tokens_to_ids(t)] for t in tokenizer.hf.all_special_tokens)


def test_a_forbidden_drawn_child_stays_as_a_leaf_its_parent_rejects(tok_dir):
    """cut_tree on a drawn tree (root: "1", "a", "0"; "1": "0"): "a" stays, a leaf, out of the
    root's mask (its later sibling "0" was drawn with it taken out of q), the q rows follow their
    nodes; on a chosen tree "a" is cut."""
    from engine.grammar import cut_tree
    from engine.token_tree import TokenTree

    tokenizer = Tokenizer(tok_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer.hf))
    one, zero, a = (tokenizer.hf.convert_tokens_to_ids(c) for c in "10a")
    V = len(tokenizer.hf)
    q = torch.rand(5, V)
    drawn = TokenTree((one, a, zero, zero), (-1, -1, -1, 0), q)
    matcher = compiler.matcher(StructuredOutput.choice(CHOICES))
    kept, masks = cut_tree(matcher, drawn, V)  # depth first: "1", its "0", "a", "0"
    assert kept.tokens == (one, zero, a, zero) and kept.parents == (-1, 0, -1, -1)
    assert torch.equal(torch.stack([kept.children_q(row) for row in range(5)]), q[[0, 1, 4, 2, 3]])
    assert masks[0, one] and masks[0, zero] and not masks[0, a]
    assert masks[3].all()  # the leaf "a": never reached
    chosen, _ = cut_tree(compiler.matcher(StructuredOutput.choice(CHOICES)), TokenTree(drawn.tokens, drawn.parents), V)
    assert chosen.tokens == (one, zero, zero) and chosen.parents == (-1, 0, -1) and chosen.q is None
