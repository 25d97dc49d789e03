"""Speculative sampling follows the target distribution exactly (chi-square, by enumeration).

A 16-token target and a perturbed copy as draft (acceptance ~0.4-0.8). For each sampling
configuration we draw N sequences with speculation (K = 2, so the 2nd and 3rd tokens come
from one verify round: accepted, recovered or bonus) and compare the empirical marginals of
the 2nd and 3rd tokens with the exact target marginals computed by enumerating every prefix.

Significance: each chi-square test rejects at p < 1e-3 (16 tests -> family-wise false alarm
< 2%). Power: with N = 3000 the test detects a total-variation shift of a few percent; the
`teeth` test shows that replacing the correction distribution norm(max(0, p - q)) with p
(a classic bug) is rejected.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import engine.speculative.verify.chain as accept_module
from engine import LLM, SamplingParams
from engine.model.kernels import one_sequence
from engine.model.token_step import TokenStep
from engine.sampling import Adjustments
from engine.speculative.proposers.base import Proposal, Proposer
from engine.speculative.verify.chain import Acceptance, verify
from tests.exactness import CONFIGS, PROMPT, N, chi2_pvalue, exact_marginals, make_pair, sample_speculative
from tests.helpers import make_eagle3_head


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tok_dir):
    tpath, dpath = tmp_path_factory.mktemp("stat_t"), tmp_path_factory.mktemp("stat_d")
    return tpath, dpath, make_pair(tpath, dpath, tok_dir)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_speculative_sampling_matches_target_marginals(pair, name):
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS[name])
    m2, m3 = exact_marginals(hf, params)
    tokens, acceptance = sample_speculative(tpath, dpath, params)
    assert 0.3 < acceptance < 0.9, f"draft should disagree sometimes (acceptance {acceptance:.2f})"
    assert chi2_pvalue(tokens[:, 1], m2) > 1e-3
    assert chi2_pvalue(tokens[:, 2], m3) > 1e-3


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_speculative_sampling_matches_target_marginals_in_every_family(tmp_path, tok_dir, model_type):
    """The same test, same N and threshold, on a pair of each other family (Qwen2's biases, Qwen3's
    q/k norms in both models)."""
    hf = make_pair(tmp_path / "t", tmp_path / "d", tok_dir, model_type)
    params = SamplingParams(**CONFIGS["t07_topk"])
    m2, m3 = exact_marginals(hf, params)
    tokens, acceptance = sample_speculative(tmp_path / "t", tmp_path / "d", params)
    assert 0.3 < acceptance < 0.9, f"draft should disagree sometimes (acceptance {acceptance:.2f})"
    assert chi2_pvalue(tokens[:, 1], m2) > 1e-3
    assert chi2_pvalue(tokens[:, 2], m3) > 1e-3


def test_teeth_correction_replaced_by_p_is_detected(pair, monkeypatch):
    def broken(p, q, draft, num_proposed, uniforms) -> Acceptance:
        good = verify(p, q, draft, num_proposed, uniforms)
        rows = torch.arange(p.shape[0])
        return good._replace(final_probs=p[rows, good.num_accepted])  # resample from p on rejection

    monkeypatch.setattr(accept_module, "verify", broken)
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS["t1"])
    m2, m3 = exact_marginals(hf, params)
    tokens, _ = sample_speculative(tpath, dpath, params)
    p2, p3 = chi2_pvalue(tokens[:, 1], m2), chi2_pvalue(tokens[:, 2], m3)
    assert min(p2, p3) < 1e-3


@pytest.mark.parametrize("name", ["t1", "t07_topk", "presence_frequency"])
def test_block_verification_matches_target_marginals(pair, name):
    """`verification: block` in the engine: the same marginals, the same test."""
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS[name])
    m2, m3 = exact_marginals(hf, params)
    tokens, acceptance = sample_speculative(tpath, dpath, params, verification="block")
    assert 0.3 < acceptance < 0.95, f"draft should disagree sometimes (acceptance {acceptance:.2f})"
    assert chi2_pvalue(tokens[:, 1], m2) > 1e-3
    assert chi2_pvalue(tokens[:, 2], m3) > 1e-3


def test_teeth_block_verification_with_a_wrong_correction_is_detected(pair, monkeypatch):
    """The engine's block path with its recovered token drawn from p (the classic bug) is rejected,
    which also shows `verification: block` reaches verify_block. (A subtler bug, the block's
    weight left out of the residual, needs the sharper whole-sequence test of test_rejection.py.)"""
    def broken(p, q, draft, num_proposed, uniforms) -> Acceptance:
        good = block(p, q, draft, num_proposed, uniforms)
        return good._replace(final_probs=p[torch.arange(p.shape[0]), good.num_accepted])

    block = accept_module.verify_block
    monkeypatch.setattr(accept_module, "verify_block", broken)
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS["t1"])
    m2, m3 = exact_marginals(hf, params)
    tokens, _ = sample_speculative(tpath, dpath, params, verification="block")
    assert min(chi2_pvalue(tokens[:, 1], m2), chi2_pvalue(tokens[:, 2], m3)) < 1e-3


class EvenTokensDraft(Proposer):
    """A proposer behind the Proposer seam whose q is zero on every odd token: the draft model's
    distribution restricted to the even ids and renormalised (what a reduced draft vocabulary,
    EAGLE-3's, gives), so every odd token the target emits must come from norm(max(0, p - q))."""

    name = "even"
    runs_model = True
    catch_up = "own"

    def __init__(self, engine):
        self.inner = engine.speculation.sources.model_proposer()
        self.long_catch_up = self.inner.long_catch_up
        self.generator = torch.Generator().manual_seed(0)

    def propose(self, requests, ks, with_q) -> Proposal:
        drafted = self.inner.propose(requests, ks, with_q=True)  # runs the draft, keeps its KV in step
        q = drafted.q.clone()  # [N, K, V]
        q[..., 1::2] = 0.0
        q /= q.sum(-1, keepdim=True)
        tokens = [[int(torch.multinomial(q[i, j], 1, generator=self.generator)) for j in range(len(t))]
                  for i, t in enumerate(drafted.tokens)]
        return Proposal(tokens, q, [self.name] * len(tokens))

    def lag(self, requests):
        return self.inner.lag(requests)


def test_a_proposer_with_zero_q_on_half_the_vocabulary_keeps_sampling_exact(pair):
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS["t1"])
    m2, m3 = exact_marginals(hf, params)
    tokens, acceptance = sample_speculative(tpath, dpath, params, proposer=EvenTokensDraft)
    assert 0.1 < acceptance < 0.9
    assert (tokens[:, 1:3] % 2 == 1).mean() > 0.1  # tokens the proposer could never propose do occur
    assert chi2_pvalue(tokens[:, 1], m2) > 1e-3
    assert chi2_pvalue(tokens[:, 2], m3) > 1e-3


@pytest.mark.parametrize("name", ["t1", "t07_topk"])
def test_eagle_sampling_matches_target_marginals(pair, tmp_path, name):
    """The same test with an EAGLE-3 head as proposer: q is its distribution over a reduced draft
    vocabulary (ids 0-11), zero on ids 12-15, which must then come from the correction alone."""
    tpath, _, hf = pair
    make_eagle3_head(tmp_path, tpath, aux=[0, 0, 0], draft_vocab=list(range(12)), lm_scale=0.5,
                     two_back=hf.model.embed_tokens.weight.detach())
    params = SamplingParams(**CONFIGS[name])
    m2, m3 = exact_marginals(hf, params)
    tokens, acceptance = sample_speculative(tpath, tmp_path, params, speculative_method="eagle")
    assert 0.05 < acceptance < 0.9, f"the head should disagree sometimes (acceptance {acceptance:.2f})"
    assert (tokens[:, 1:3] >= 12).mean() > 0.02  # tokens outside the draft vocabulary do occur
    assert chi2_pvalue(tokens[:, 1], m2) > 1e-3
    assert chi2_pvalue(tokens[:, 2], m3) > 1e-3


@pytest.mark.skipif(one_sequence.load() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_sampled_drafting_in_one_c_call_matches_target_marginals(pair, tmp_path, method):
    """The same test with the proposer's steps after a round's first token drawn inside one C
    call (TokenStep.draft at a temperature; batches of at most 8 rows, the token step forced), at
    K = 3 for odd seeds and K = 1 for even ones: the 2nd to 4th tokens of a K = 3 row come from one
    round whose 3rd and 4th were drafted in C (for a head, through its reduced vocabulary), beside
    rows that propose fewer."""
    tpath, dpath, hf = pair
    if method == "eagle":
        dpath = tmp_path
        make_eagle3_head(tmp_path, tpath, aux=[0, 0, 0], draft_vocab=list(range(12)), lm_scale=0.5,
                         two_back=hf.model.embed_tokens.weight.detach())
    steps = []
    original = TokenStep.draft

    def counted(self, first, kv, positions, n, *rest, **kw):
        tokens, q = original(self, first, kv, positions, n, *rest, **kw)
        steps.append(n if q is not None else 0)
        return tokens, q

    params = SamplingParams(**CONFIGS["t1"])
    m2, m3, m4 = exact_marginals(hf, params, fourth=True)
    llm = LLM(model=str(tpath), draft_model=str(dpath), use_speculative_decoding=True, spec_policy="fixed",
              spec_length=3, dtype="float32", max_seq_len=32, max_batch_size=8, seed=1, speculative_method=method,
              forward_plan={"draft": {"dtype": "float32", "token_step": True}})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TokenStep, "draft", counted)
        outs = llm.generate([PROMPT] * N, [SamplingParams(**CONFIGS["t1"], max_tokens=5, ignore_eos=True, seed=i,
                                                          spec_length=1 + 2 * (i % 2)) for i in range(N)])
    tokens = np.array([o.token_ids for o in outs])  # [N, 5]
    assert steps and 0 not in steps and 2 in steps  # every loop call sampled; rounds of K = 3 drafted 2 steps in C
    assert 0.05 < sum(o.num_accepted_tokens for o in outs) / sum(o.num_draft_tokens for o in outs) < 0.9
    for column, expected in zip((1, 2, 3), (m2, m3, m4)):
        assert chi2_pvalue(tokens[:, column], expected) > 1e-3


def repeat_pvalue(tokens: np.ndarray, joint23: np.ndarray) -> float:
    """p-value that the 3rd token repeats the 2nd as often as the target's joint says (the event
    the presence and frequency penalties act on)."""
    expected = float(np.trace(joint23)) * len(tokens)
    observed = float((tokens[:, 1] == tokens[:, 2]).sum())
    return chisquare([observed, len(tokens) - observed], [expected, len(tokens) - expected]).pvalue


@pytest.mark.parametrize("blind", [False, True], ids=["exact", "teeth"])
def test_penalties_count_the_rounds_proposals(pair, monkeypatch, blind):
    """The presence and frequency penalties at verify position j count proposals t_1..t_j: the rate
    at which the 3rd token repeats the 2nd (a verify round's second position, when its first
    proposal is accepted) follows the target; a target blind to the round's proposals is rejected."""

    if blind:
        grown = Adjustments.grown
        monkeypatch.setattr(Adjustments, "grown", lambda self, tokens, lengths: grown(self, tokens, 0 * lengths))
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS["presence_frequency"])
    _, _, joint23 = exact_marginals(hf, params, joint23=True)
    tokens, _ = sample_speculative(tpath, dpath, params)
    p = repeat_pvalue(tokens, joint23)
    assert (p < 1e-3) if blind else (p > 1e-3), p


@pytest.mark.parametrize("allocation", ["policy", "mixed"])
def test_a_k_per_request_keeps_sampling_exact(pair, monkeypatch, allocation):
    """With k_per_request, as the adaptive policy allocates (at fixed prices, not this host's
    timings: a verify token costs 0.4 of a row's plain step, so a position is worth proposing
    where it survives more often than that), and with every step forced to give the rows of one
    packed verify pass K = 0, 1 and 2 in turn."""
    from engine.speculative.policy.per_request import Allocation, PerRequestPolicy
    from tests.helpers import fixed_step_prices

    if allocation == "policy":
        fixed_step_prices(monkeypatch)
    else:
        def mixed(self, view, prices):
            return Allocation([min(c, i % 3) for i, c in enumerate(view.allowed())], "policy", 1.0, 1.0)
        monkeypatch.setattr(PerRequestPolicy, "choose", mixed)
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS["t1"])
    m2, m3 = exact_marginals(hf, params)
    tokens, acceptance = sample_speculative(tpath, dpath, params, spec_policy="adaptive", k_per_request=True)
    assert 0.3 < acceptance < 0.9
    assert chi2_pvalue(tokens[:, 1], m2) > 1e-3
    assert chi2_pvalue(tokens[:, 2], m3) > 1e-3
