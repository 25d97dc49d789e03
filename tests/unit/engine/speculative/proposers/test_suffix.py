"""Suffix decoding: drafts scored by what followed earlier occurrences, the cache's bound and
scopes, and in the engine greedy output equal to plain greedy output (alone and in hybrid, chains
and trees) and sampled output following the target distribution (chi-square, with teeth)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

import engine.speculative.proposers.suffix as suffix
import engine.speculative.step as step_module
import engine.speculative.verify.tree as tree_round
from engine import LLM, SamplingParams
from engine.config import SpecConfig
from engine.speculative.proposers.suffix import (
    MIN_PROB,
    DraftLimits,
    SuffixCache,
    SuffixProposer,
    best_draft,
    own_text_draft,
)
from tests.exactness import (
    CONFIGS,
    PROMPT,
    chi2_pvalue,
    exact_marginals,
    make_pair,
    no_residual,
    sample_speculative,
)
from tests.unit.engine.speculative.test_tree_engine import PROMPTS, branching, greedy, reference  # noqa: F401 (fixtures)


def _cache_with(texts: list[list[int]], max_tokens: int = 10_000, scope: str = "") -> SuffixCache:
    cache = SuffixCache(max_tokens)
    for t in texts:
        cache.add(scope, t)
    return cache


@dataclass
class _Request:
    """What a lookup reads of a request."""

    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def _request(tokens: list[int], **params) -> _Request:
    return _Request(list(tokens), SamplingParams(**params))


def test_a_draft_is_the_tree_of_what_followed_scored_by_share():
    # a match of m tokens proposes at most m nodes (factor 1, SPEC_FACTOR)
    # after (1, 2): 5 6 three times, 5 7 once, 8 once -> 5 (4/5), 6 under it (3/5), 7 (1/5), 8 (1/5)
    cache = _cache_with([[1, 2, 5, 6], [1, 2, 5, 6], [9, 1, 2, 5, 6], [1, 2, 5, 7], [1, 2, 8]])
    draft = cache.draft("", np.array([4, 1, 2]), DraftLimits(depth=4, max_nodes=8, width=3))
    assert draft.match == 2
    assert list(zip(draft.tree.tokens, draft.tree.parents)) == [(5, -1), (6, 0)]  # match 2: at most 2 nodes
    assert draft.score == pytest.approx(4 / 5 + 3 / 5)
    draft = cache.draft("", np.array([9, 1, 2]), DraftLimits(depth=4, max_nodes=8, width=3))
    assert draft.match == 3 and draft.tree.tokens == (5, 6)  # the longer match: one occurrence, certain
    wide = best_draft(*_text_of([[0, 1, 2, 5, 6], [0, 1, 2, 5, 6], [0, 1, 2, 5, 7], [0, 1, 2, 8]]),
                      np.array([0, 1, 2]), DraftLimits(depth=3, max_nodes=8, width=3))
    assert list(zip(wide.tree.tokens, wide.tree.parents)) == [(5, -1), (6, 0), (8, -1)]  # 3 nodes; ties: shallower first
    narrow = best_draft(*_text_of([[0, 1, 2, 5, 6], [0, 1, 2, 5, 6], [0, 1, 2, 5, 7], [0, 1, 2, 8]]),
                        np.array([0, 1, 2]), DraftLimits(depth=3, max_nodes=8, width=1))
    assert narrow.tree.is_chain and narrow.tree.tokens == (5, 6)
    assert cache.draft("", np.array([4, 1, 2]), DraftLimits(depth=4, max_nodes=8, width=3, factor=2.0)).tree.tokens == (5, 6, 8, 7)
    proposer = SuffixProposer(SuffixCache(10), "all", vocab_size=16, device="cpu")
    assert proposer.limits(1, 4, 8, 3).factor == suffix.ALONE_SPEC_FACTOR
    assert proposer.limits(16, 4, 8, 3).factor == suffix.SPEC_FACTOR


def _text_of(texts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    text = np.concatenate([np.concatenate(([-1], t)) for t in texts]).astype(np.int64)
    ends = np.flatnonzero((text[:-1] == 1) & (text[1:] == 2)) + 1
    return text, ends


def test_nodes_below_the_least_score_are_not_proposed():
    rare = [[1, 2, 3, 4]] + [[1, 2, 5, 6]] * int(1 / MIN_PROB)  # 3 follows in fewer than MIN_PROB of them
    draft = _cache_with(rare).draft("", np.array([0, 1, 2]), DraftLimits(depth=2, max_nodes=8, width=4))
    assert 3 not in draft.tree.tokens and draft.tree.tokens == (5, 6)


def test_own_text_never_matches_the_context_end_itself():
    assert own_text_draft(np.array([1, 2, 3, 1, 2]), DraftLimits(depth=2, max_nodes=2, width=1)).tree.tokens == (3, 1)
    assert own_text_draft(np.array([7, 1, 2]), DraftLimits(depth=2, max_nodes=2, width=1)) is None


def test_the_cache_keeps_at_most_its_budget_and_forgets_the_oldest_first():
    cache = SuffixCache(max_tokens=100)
    rng = np.random.default_rng(0)
    for i in range(200):
        cache.add("", [1000 + i, 1000 + i + 1] + rng.integers(0, 50, 20).tolist())
        assert cache.num_tokens <= 100
    assert cache.nbytes < 100 * (4 + 8 + 8) * 4  # buffers grow by doubling, never past a few times the budget
    assert cache.draft("", np.array([1000, 1001]), DraftLimits(2, 2, 1)) is None  # the first text is gone
    assert cache.draft("", np.array([1000 + 199, 1000 + 200]), DraftLimits(2, 2, 1)) is not None
    cache.evict(0)
    assert cache.num_tokens == 0 and cache.num_texts == 0


def test_scopes_are_apart_and_opted_out_or_tenantless_requests_are_never_stored():
    proposer = SuffixProposer(SuffixCache(1000), "tenant", vocab_size=64, device="cpu")
    finished = _request([1, 2], tenant="a")
    finished.output_token_ids = [3, 4, 5, 6]
    proposer.learn(finished)
    anonymous = _request([1, 2])
    anonymous.output_token_ids = [3, 4, 9, 9]
    proposer.learn(anonymous)
    opted_out = _request([1, 2], tenant="a", spec_length=0)
    opted_out.output_token_ids = [3, 4, 7, 7]
    proposer.learn(opted_out)
    assert proposer.cache.num_texts == 1
    assert proposer.propose([_request([8, 3, 4], tenant="a")], [2], False).tokens == [[5, 6]]
    assert proposer.propose([_request([8, 3, 4], tenant="b")], [2], False).tokens == [[]]
    assert proposer.propose([_request([8, 3, 4])], [2], False).tokens == [[]]


def test_suffix_settings_are_validated():
    with pytest.raises(ValueError, match="suffix_cache_tokens"):
        SpecConfig(suffix_cache_tokens=-1)
    with pytest.raises(ValueError, match="suffix_sharing"):
        SpecConfig(suffix_sharing="everyone")
    with pytest.raises(ValueError, match="hybrid_lookup"):
        SpecConfig(hybrid_lookup="eagle")
    with pytest.raises(ValueError, match="tenant"):
        SamplingParams(tenant="")


@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("width", [1, 3])
def test_suffix_greedy_equals_plain(tiny_model, reference, monkeypatch, backend, policy, width):  # noqa: F811 (a fixture)
    monkeypatch.setattr(step_module, "TREE_COST_SLACK", 1e9)  # trees in every round the adaptive K allows,
    monkeypatch.setattr(step_module.SpeculativeDecoder, "_take_trees", lambda self, reqs: True)  # whatever they cost
    llm = LLM(model=str(tiny_model[0]), use_speculative_decoding=True, speculative_method="suffix",
              spec_policy=policy, spec_length=6, tree_width=width, tree_tokens=10, dtype="float32",
              kv_cache_backend=backend, block_size=4, max_seq_len=200, max_batch_size=8, enable_prefix_caching=True)
    alone = [llm.generate(p, greedy())[0] for p in PROMPTS]
    assert llm.engine.speculation.suffix_cache.num_texts == len(PROMPTS)
    again = llm.generate(PROMPTS, greedy())  # each answer is in the cache now: long matches
    assert [o.token_ids for o in alone] == reference
    assert [o.token_ids for o in again] == reference
    if policy == "fixed":  # (the adaptive K may price speculation out for the tiny model)
        assert sum(o.num_accepted_tokens for o in again) > sum(o.num_accepted_tokens for o in alone)
    assert all(pool.num_used_slots() == 0 for pool in llm.engine.kv.pools().values())


@pytest.mark.parametrize("width", [1, 3])
def test_hybrid_with_suffix_lookup_greedy_equals_plain(tiny_model, tiny_draft, reference, width):  # noqa: F811 (a fixture)
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
              speculative_method="hybrid", hybrid_lookup="suffix", spec_policy="fixed", spec_length=4,
              tree_width=width, dtype="float32", max_seq_len=200, max_batch_size=8)
    first = llm.generate(PROMPTS, greedy())
    again = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in first] == reference and [o.token_ids for o in again] == reference
    assert llm.engine.speculation.proposer.lookup.name == "suffix"
    assert sum(o.num_accepted_tokens for o in again) > sum(o.num_accepted_tokens for o in first)


def test_a_live_switch_to_suffix_and_back_keeps_greedy_output(tiny_model, reference):  # noqa: F811 (a fixture)
    llm = LLM(model=str(tiny_model[0]), use_speculative_decoding=True, speculative_method="ngram",
              spec_policy="fixed", spec_length=4, dtype="float32", max_seq_len=200, max_batch_size=8)
    engine = llm.engine
    llm.generate(PROMPTS, greedy())
    ids = [engine.add_request(p, greedy()) for p in PROMPTS]
    settings = iter([dict(speculative_method="suffix", tree_width=3), dict(speculative_method="ngram", tree_width=1),
                     dict(suffix_cache_tokens=30)] * 50)
    while engine.has_unfinished_requests():
        engine.step()
        engine.reconfigure_speculation(**next(settings))
    assert [engine.get_output(i).token_ids for i in ids] == reference
    assert engine.speculation.suffix_cache.num_tokens <= 30


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tok_dir):
    tpath, dpath = tmp_path_factory.mktemp("suffix_t"), tmp_path_factory.mktemp("suffix_d")
    return tpath, dpath, make_pair(tpath, dpath, tok_dir)


def _warm_suffix(m2, m3):
    """A suffix proposer over a cache holding the prompt followed by likely and unlikely tokens
    (finished outputs join it as the test runs)."""
    likely2 = [int(i) for i in (-m2).argsort()[:3]]
    likely3 = [int(i) for i in (-m3).argsort()[:2]]

    def build(engine):
        proposer = engine.speculation.proposer
        for a in likely2:
            for b in likely3:
                proposer.cache.add("", PROMPT + [a, b])
        return proposer
    return build


@pytest.mark.parametrize("name,width", [("t1", 1), ("t1", 3), ("t07_topk", 3)])
def test_suffix_sampling_matches_target_marginals(pair, branching, name, width):  # noqa: F811
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS[name])
    m2, m3 = exact_marginals(hf, params)
    tokens, acceptance = sample_speculative(tpath, dpath, params, speculative_method="suffix", tree_width=width,
                                            tree_tokens=8, proposer=_warm_suffix(m2, m3))
    assert acceptance > 0.05
    assert (branching["branched"] > 0) == (width > 1), branching
    assert chi2_pvalue(tokens[:, 1], m2) > 1e-3
    assert chi2_pvalue(tokens[:, 2], m3) > 1e-3


def test_teeth_suffix_trees_without_the_residual_are_detected(pair, monkeypatch):
    monkeypatch.setattr(tree_round, "accept_sampled", no_residual)
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS["t1"])
    m2, m3 = exact_marginals(hf, params)
    tokens, _ = sample_speculative(tpath, dpath, params, speculative_method="suffix", tree_width=3, tree_tokens=8,
                                   proposer=_warm_suffix(m2, m3))
    assert min(chi2_pvalue(tokens[:, 1], m2), chi2_pvalue(tokens[:, 2], m3)) < 1e-3


def test_the_openai_user_is_the_tenant():
    from serve_app.protocol import CompletionRequest

    assert CompletionRequest(prompt="x", user="alice").sampling_params(16).tenant == "alice"
    assert CompletionRequest(prompt="x").sampling_params(16).tenant is None


@pytest.mark.parametrize("width", [1, 3])
def test_constrained_greedy_output_is_the_same_with_suffix_proposals(tiny_model, width):
    from engine.structured_output import StructuredOutput

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array",
              "items": {"type": "integer"}, "maxItems": 4}}, "required": ["a", "b"]}
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_output=StructuredOutput.json_schema(schema))
    plain = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=200)
    suffix = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=200, use_speculative_decoding=True,
                 speculative_method="suffix", spec_policy="fixed", spec_length=6, tree_width=width, tree_tokens=10)
    prompts = PROMPTS[:3]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    first = suffix.generate(prompts, params)
    again = suffix.generate(prompts, params)  # the answers' shapes are in the cache now
    assert [o.token_ids for o in first] == expected and [o.token_ids for o in again] == expected
    assert sum(o.num_accepted_tokens for o in again) > 0
