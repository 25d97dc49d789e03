"""Token-tree rounds drafted by the model proposers (draft model, EAGLE-3 head, hybrid): greedy output
equals plain greedy output (slotted and paged, fixed and adaptive K, prefix-cache hits, a live
switch between trees and chains); the head reads the target features of the accepted path after
a tree round (teeth: those of the pass's first rows are detected); sampled model trees follow the
target distribution at T = 1, at T = 0.7 with top-k, and under a grammar (chi-square, with teeth)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import engine.speculative.step as step_module
import engine.speculative.verify.tree as tree_round
from engine import LLM, SamplingParams
from engine.kv import KVManager
from tests.exactness import CONFIGS, chi2_pvalue, exact_marginals, make_pair, no_residual, sample_speculative
from tests.helpers import greedy, make_eagle3_head, make_model

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x",
    "for i in range(10):\n    print(i * i)\nfor i in range(10):\n",
    "import os",
    "x",
    "print(os.path.join('a', 'b'))\n" * 3,
]
AUX = [0, 1, 1]





@pytest.fixture(scope="module")
def close_draft(tmp_path_factory, tok_dir):
    """The tiny target with noise on every weight as draft model (conftest's tiny_draft agrees with
    it on almost nothing here): chains accept about half a token a round, trees more."""
    path = tmp_path_factory.mktemp("close_draft")
    hf = make_model(path, tok_dir, seed=0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * p.std() * torch.randn_like(p))
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=200, max_batch_size=8)
    return [o.token_ids for o in llm.generate(PROMPTS, greedy())]


@pytest.fixture
def rounds(monkeypatch):
    """Counts the tree rounds accept_trees saw, the branched ones, and the model proposers' trees."""
    seen = {"trees": 0, "branched": 0, "accepted": 0, "deep": 0}  # deep: paths off the first rows
    real = tree_round.accept_trees

    def counting(reqs, trees, logits):
        paths, finals = real(reqs, trees, logits)
        for t, p in zip(trees, paths):
            if t is not None and len(t):
                seen["trees"] += 1
                seen["branched"] += int(len(t) > t.depth)
                seen["accepted"] += len(p)
                seen["deep"] += int(p != list(range(len(p))))
        return paths, finals

    monkeypatch.setattr(step_module, "accept_trees", counting)
    return seen


def _draft_path(method: str, close_draft, tiny_head) -> str:
    return str(tiny_head if method.endswith("eagle") else close_draft)


METHODS = ["draft", "eagle", "hybrid-eagle", "hybrid-draft"]


@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_model_trees_greedy_equals_plain(tiny_model, close_draft, tiny_head, reference, rounds, monkeypatch, backend,
                                         method, policy):
    monkeypatch.setattr(step_module, "TREE_COST_SLACK", 1e9)  # trees in every round the adaptive K allows,
    monkeypatch.setattr(step_module.SpeculativeDecoder, "_take_trees", lambda self, reqs: True)  # whatever they cost
    llm = LLM(model=str(tiny_model[0]), draft_model=_draft_path(method, close_draft, tiny_head),
              use_speculative_decoding=True, speculative_method=method.split("-")[0], spec_policy=policy,
              spec_length=4, tree_width=3, tree_tokens=10, dtype="float32", kv_cache_backend=backend, block_size=4,
              max_seq_len=200, max_batch_size=8, enable_prefix_caching=True)
    first = llm.generate(PROMPTS[:3], greedy(8))
    batched = llm.generate(PROMPTS, greedy())  # the first prompts' blocks come from the prefix cache now
    assert [o.token_ids for o in first] == [r[:8] for r in reference[:3]]
    assert [o.token_ids for o in batched] == reference
    if policy == "fixed":
        assert rounds["branched"] > 0 and rounds["accepted"] > 0, rounds
    assert all(pool.num_used_slots() == 0 for pool in llm.engine.kv.pools().values())


@pytest.mark.parametrize("method", ["draft", "eagle", "hybrid-eagle"])
def test_a_live_switch_between_model_trees_and_chains_keeps_greedy_output(tiny_model, close_draft, tiny_head,
                                                                         reference, rounds, method):
    llm = LLM(model=str(tiny_model[0]), draft_model=_draft_path(method, close_draft, tiny_head),
              use_speculative_decoding=True, speculative_method=method.split("-")[0], spec_policy="fixed",
              spec_length=4, tree_width=3, dtype="float32", max_seq_len=200, max_batch_size=8)
    engine = llm.engine
    ids = [engine.add_request(p, greedy()) for p in PROMPTS]
    widths = iter([1, 3, 3, 1, 3, 1, 1] * 50)
    while engine.has_unfinished_requests():
        engine.step()
        engine.reconfigure_speculation(tree_width=next(widths))
    assert [engine.get_output(i).token_ids for i in ids] == reference
    assert rounds["trees"] > 0 and rounds["accepted"] > 0, rounds


@pytest.mark.parametrize("teeth", [False, True], ids=["accepted_path", "first_rows"])
def test_after_a_tree_round_the_head_reads_the_accepted_paths_features(tiny_model, tiny_head, rounds, monkeypatch,
                                                                       teeth):
    """Every feature the head is handed equals the target's at that position of the emitted
    sequence (the inputs of its layers, computed by the reference model over the whole output).
    Teeth: keeping the tree pass's first a + 1 rows instead of the accepted path's is detected."""
    if teeth:
        real = KVManager.keep_paths

        def first_rows(self, requests, starts, paths, features=None):
            real(self, requests, starts, paths)
            if features is not None:
                for i, (r, s, p) in enumerate(zip(requests, starts, paths)):
                    self.features.append(r.request_id, s, features[i, :len(p) + 1])

        monkeypatch.setattr(KVManager, "keep_paths", first_rows)
    path, hf = tiny_model
    llm = LLM(model=str(path), draft_model=str(tiny_head), use_speculative_decoding=True, speculative_method="eagle",
              spec_policy="fixed", spec_length=4, tree_width=3, tree_tokens=10, dtype="float32", max_seq_len=200,
              max_batch_size=8)
    features = llm.engine.kv.features
    taken: list[tuple[str, int, torch.Tensor]] = []
    take = features.take

    def recording(request_id):
        got = take(request_id)
        if got is not None:
            taken.append((request_id, got.start, got.rows.clone()))
        return got

    features.take = recording
    outs = llm.generate(PROMPTS, greedy(30))
    assert rounds["deep"] > 0 and rounds["branched"] > 0, rounds
    mismatched = 0
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids + o.token_ids])
        with torch.no_grad():
            states = hf(input_ids=ids, output_hidden_states=True).hidden_states
        want = torch.cat([states[i] for i in AUX], -1)[0]  # [T, 3H]
        for request_id, start, rows in taken:
            if request_id == o.request_id:
                mismatched += not torch.allclose(rows, want[start:start + rows.shape[0]], rtol=1e-4, atol=1e-4)
    assert (mismatched > 0) if teeth else (mismatched == 0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tok_dir):
    """test_spec_statistical's 16-token target and its perturbed copy as draft model."""
    tpath, dpath = tmp_path_factory.mktemp("mtree_t"), tmp_path_factory.mktemp("mtree_d")
    return tpath, dpath, make_pair(tpath, dpath, tok_dir)


def _sampled_trees(pair, tmp_path, method: str, params: SamplingParams, rounds: dict):
    tpath, dpath, hf = pair
    if method == "eagle":  # test_spec_statistical's head over the pair's target (draft vocabulary: ids 0-11)
        dpath = tmp_path
        make_eagle3_head(tmp_path, tpath, aux=[0, 0, 0], draft_vocab=list(range(12)), lm_scale=0.5,
                         two_back=hf.model.embed_tokens.weight.detach())
    tokens, _ = sample_speculative(tpath, dpath, params, speculative_method=method, tree_width=3, tree_tokens=6)
    assert rounds["branched"] > 1000 and rounds["accepted"] > 300, rounds  # most rounds were branched trees
    return tokens


@pytest.mark.parametrize("method,name", [("draft", "t1"), ("draft", "t07_topk"), ("eagle", "t1")])
def test_sampled_model_trees_match_target_marginals(pair, tmp_path, rounds, method, name):
    params = SamplingParams(**CONFIGS[name])
    m2, m3 = exact_marginals(pair[2], params)
    tokens = _sampled_trees(pair, tmp_path, method, params, rounds)
    assert chi2_pvalue(tokens[:, 1], m2) > 1e-3
    assert chi2_pvalue(tokens[:, 2], m3) > 1e-3


def test_teeth_model_trees_without_the_residual_are_detected(pair, tmp_path, rounds, monkeypatch):
    monkeypatch.setattr(tree_round, "accept_sampled", no_residual)
    params = SamplingParams(**CONFIGS["t1"])
    m2, m3 = exact_marginals(pair[2], params)
    tokens = _sampled_trees(pair, tmp_path, "draft", params, rounds)
    assert min(chi2_pvalue(tokens[:, 1], m2), chi2_pvalue(tokens[:, 2], m3)) < 1e-3


@pytest.mark.parametrize("masked", [True, False])
def test_sampled_model_trees_under_a_grammar_follow_the_masked_target_distribution(tiny_model, tiny_draft, tok_dir,
                                                                                   rounds, monkeypatch, masked):
    """test_structured_output's choice grammar, every allowed path enumerated, with the draft
    model's trees (drafted within the grammar) verified every round. Teeth: with the masks left out
    of the tree pass, outputs leave the grammar."""
    from scipy.stats import chisquare

    from engine.structured_output import StructuredOutput
    from tests.exactness import CHOICES, N, exact_grammar_outcomes

    if not masked:
        monkeypatch.setattr(step_module, "mask_logits", lambda logits, masks: logits)
    tpath, hf = tiny_model
    spec = StructuredOutput.choice(CHOICES)
    prompt = [5, 17, 9, 30]
    expected = exact_grammar_outcomes(hf, tok_dir, prompt, spec, depth=4)
    llm = LLM(model=str(tpath), draft_model=str(tiny_draft[0]), dtype="float32", max_batch_size=64, seed=7,
              use_speculative_decoding=True, speculative_method="draft", spec_length=2, spec_policy="fixed",
              tree_width=3, tree_tokens=6)  # within the grammar even tiny_draft's trees are accepted
    n = N if masked else N // 10  # the teeth need few outputs
    outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=4, structured_output=spec))
    seen = Counter(tuple(o.token_ids) for o in outs)
    if not masked:
        assert not set(seen) <= set(expected)
        return
    assert set(seen) <= set(expected)
    assert rounds["branched"] >= N // 2 and rounds["accepted"] >= N // 2, rounds  # branched model trees
    keys = sorted(expected, key=expected.get, reverse=True)
    big = [k for k in keys if expected[k] * N >= 5]
    f_exp = [expected[k] * N for k in big] + [N * (1 - sum(expected[k] for k in big))]
    f_obs = [seen[k] for k in big] + [N - sum(seen[k] for k in big)]
    if f_exp[-1] < 5:
        f_exp, f_obs = f_exp[:-2] + [f_exp[-2] + f_exp[-1]], f_obs[:-2] + [f_obs[-2] + f_obs[-1]]
    assert len(big) >= 3
    assert chisquare(f_obs, f_exp).pvalue > 1e-3, (f_obs, f_exp)
