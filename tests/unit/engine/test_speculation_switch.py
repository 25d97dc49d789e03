"""One rule for a speculation field given while speculation is off, in all four entry points
(`LLM(...)`, `EngineConfig`, a serve config's `engine` mapping, live reconfiguration): the field
turns speculation on when what it needs resolves, else it is a ValueError naming the field; with
use_speculative_decoding false, any other speculation field is a ValueError naming it."""

from __future__ import annotations

import copy

import pytest
import yaml

from engine import LLM, SamplingParams
from engine.config import EngineConfig, SpecConfig, with_embedded_defaults
from serve_app.openai_serving import engine_config
from tests.serve_fixture import REPO

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


def _rounds(llm: LLM) -> int:
    return llm.generate(PROMPT, GREEDY)[0].num_spec_rounds


def _serve_engine() -> dict:
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    return copy.deepcopy(config["applications"][0]["args"]["engine"])


def test_specconfig_is_off_by_default_and_on_when_a_field_is_given():
    assert not SpecConfig().use_speculative_decoding
    assert SpecConfig(speculative_method="ngram").use_speculative_decoding
    assert SpecConfig(spec_length=3, draft_model="d").use_speculative_decoding
    with pytest.raises(ValueError, match=r"speculative_method='draft' needs a draft model \(draft_model\) "
                                         r"\(\['spec_policy'\] given, which turns speculation on\)"):
        SpecConfig(spec_policy="fixed")
    with pytest.raises(ValueError, match=r"use_speculative_decoding is false, so \['spec_length', 'tree_width'\] "
                                         "would do nothing"):
        SpecConfig(use_speculative_decoding=False, spec_length=3, tree_width=2)
    assert not SpecConfig(use_speculative_decoding=False).use_speculative_decoding


@pytest.mark.parametrize("build", ["flat", "nested"])
def test_engine_config_follows_the_rule_flat_and_nested(build):
    def config(**spec):
        return EngineConfig.from_kwargs(model="m", **spec) if build == "flat" else \
            EngineConfig(model="m", speculative=spec)

    assert not config().use_speculative_decoding
    assert config(speculative_method="suffix").use_speculative_decoding
    with pytest.raises(ValueError, match=r"speculative_method='eagle' needs a draft model \(draft_model\)"):
        config(speculative_method="eagle")
    with pytest.raises(ValueError, match=r"use_speculative_decoding is false, so \['draft_model'\]"):
        config(use_speculative_decoding=False, draft_model="d")


def test_llm_with_a_model_and_a_method_speculates_or_names_what_it_lacks(tiny_model, tiny_draft):
    """Before: LLM(model=..., speculative_method=...) decoded plainly, without a word."""
    target = str(tiny_model[0])
    common = dict(model=target, dtype="float32", max_seq_len=128, spec_policy="fixed")
    assert _rounds(LLM(**common, speculative_method="ngram")) > 0
    assert _rounds(LLM(**common, speculative_method="draft", draft_model=str(tiny_draft[0]))) > 0
    with pytest.raises(ValueError, match=r"speculative_method='eagle' needs a draft model \(draft_model\)"):
        LLM(**common, speculative_method="eagle")
    with pytest.raises(ValueError, match=r"use_speculative_decoding is false, so \['spec_length', 'spec_policy', "
                                         r"'speculative_method'\]"):
        LLM(**common, speculative_method="ngram", spec_length=3, use_speculative_decoding=False)
    assert _rounds(LLM(model=target, dtype="float32", max_seq_len=128)) == 0  # nothing given: plain


def test_llm_embedded_off_takes_none_of_the_pairs_speculation_defaults():
    llm_config = EngineConfig.from_kwargs(**with_embedded_defaults({"use_speculative_decoding": False}))
    assert not llm_config.use_speculative_decoding and llm_config.draft_model is None


def test_a_serve_configs_engine_mapping_follows_the_rule():
    engine = _serve_engine()
    assert engine_config(engine).use_speculative_decoding  # the shipped config: on, the embedded head
    engine["speculative"]["use_speculative_decoding"] = False  # switched off, the other fields left in place
    with pytest.raises(ValueError, match=r"use_speculative_decoding is false, so \['spec_length', 'spec_policy', "
                                         r"'speculative_method'\] would do nothing"):
        engine_config(engine)
    engine["speculative"] = {"use_speculative_decoding": False}
    assert not engine_config(engine).use_speculative_decoding
    own = {"model": "some/checkpoint", "speculative": {"speculative_method": "eagle"}}
    with pytest.raises(ValueError, match=r"speculative_method='eagle' needs a draft model"):
        engine_config(own)


def test_live_reconfiguration_follows_the_rule(tiny_model):
    llm = LLM(model=str(tiny_model[0]), speculative_method="ngram", spec_policy="fixed", dtype="float32",
              max_seq_len=128)
    engine = llm.engine
    with pytest.raises(ValueError, match=r"use_speculative_decoding is false, so \['spec_length'\]"):
        engine.reconfigure_speculation(use_speculative_decoding=False, spec_length=2)
    assert engine.config.speculative.use_speculative_decoding  # a refused change changes nothing
    engine.reconfigure_speculation(use_speculative_decoding=False)
    assert _rounds(llm) == 0
    assert engine.reconfigure_speculation(spec_length=2).use_speculative_decoding  # a field given turns it on
    assert _rounds(llm) > 0 and engine.speculation.settings.spec_length == 2


def test_live_reconfiguration_of_an_engine_started_plain_names_the_field(tiny_model):
    """Before: the change was stored and did nothing."""
    engine = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=128).engine
    for change in ({"spec_length": 3}, {"speculative_method": "ngram"}, {"use_speculative_decoding": True}):
        with pytest.raises(ValueError, match=rf"not configured for this engine at start-up, so \['{next(iter(change))}'\]"):
            engine.reconfigure_speculation(**change)
    assert not engine.reconfigure_speculation(use_speculative_decoding=False).use_speculative_decoding


def test_fixed_with_k_per_request_given_true_is_an_error_naming_both():
    """k_per_request is the adaptive policy's: given true with spec_policy fixed it would do
    nothing, at start-up and live (true given before, then fixed); false, or adaptive, is fine."""
    both = r"spec_policy='fixed' with k_per_request=true"
    with pytest.raises(ValueError, match=both):
        SpecConfig(speculative_method="ngram", spec_policy="fixed", k_per_request=True)
    with pytest.raises(ValueError, match=both):
        EngineConfig.from_kwargs(model="m", speculative_method="ngram", spec_policy="fixed", k_per_request=True)
    assert not SpecConfig(speculative_method="ngram", spec_policy="fixed", k_per_request=False).k_per_request
    per_request = SpecConfig(speculative_method="ngram", spec_policy="adaptive", k_per_request=True)
    with pytest.raises(ValueError, match=both):
        per_request.updated({"spec_policy": "fixed"})
    with pytest.raises(ValueError, match=both):
        per_request.updated({"spec_policy": "fixed", "k_per_request": True})
    fixed = per_request.updated({"spec_policy": "fixed", "k_per_request": False})
    assert (fixed.spec_policy, fixed.k_per_request) == ("fixed", False)
    assert fixed.updated({"spec_policy": "adaptive", "k_per_request": True}).k_per_request
