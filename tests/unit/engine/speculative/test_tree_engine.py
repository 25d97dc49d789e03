"""Token-tree rounds in the engine: greedy output equals plain greedy output (n-gram trees,
slotted and paged, fixed and adaptive K, prefix-cache hits, a live switch between trees and
chains), and sampled trees follow the target distribution (chi-square, with teeth)."""

from __future__ import annotations

import pytest

import engine.speculative.planner as planner_module
import engine.speculative.step as step_module
import engine.speculative.verify.tree as tree_round
from engine import LLM, SamplingParams
from engine.speculative.policy.k_choice import SpecPolicy
from engine.speculative.proposers.base import Proposal, Proposer
from engine.token_tree import TokenTree
from tests.exactness import CONFIGS, chi2_pvalue, exact_marginals, make_pair, no_residual, sample_speculative
from tests.helpers import greedy

# prompts whose suffixes occurred before with different continuations: n-gram trees branch
PROMPTS = [
    "x = 1\ny = 2\nx = 3\ny = 4\nx = 5\ny =",
    "def add(a, b):\n    return a + b\n\ndef add(a, c):\n    return a - c\n\ndef add(a,",
    "for i in range(10):\n    print(i)\nfor i in range(3):\n    print(i * i)\nfor i in",
    "print(os.path.join('a', 'b'))\n" * 3,
    "The cat sat. The dog ran. The cat ran. The",
]



@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=200, max_batch_size=8)
    return [o.token_ids for o in llm.generate(PROMPTS, greedy())]


@pytest.fixture
def branching(monkeypatch):
    """Records how many of the trees accept_trees saw branched (more nodes than depth)."""
    seen = {"trees": 0, "branched": 0}
    real = tree_round.accept_trees

    def counting(reqs, trees, logits):
        for t in trees:
            if t is not None:
                seen["trees"] += 1
                seen["branched"] += int(len(t) > t.depth)
        return real(reqs, trees, logits)

    monkeypatch.setattr(step_module, "accept_trees", counting)
    return seen


@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_ngram_trees_greedy_equals_plain(tiny_model, reference, branching, monkeypatch, backend, policy):
    monkeypatch.setattr(step_module, "TREE_COST_SLACK", 1e9)  # trees in every round the adaptive K allows,
    monkeypatch.setattr(step_module.SpeculativeDecoder, "_take_trees", lambda self, reqs: True)  # whatever they cost
    # the adaptive K at fixed prices (a verify token 0.4 of a row's plain step), not this host's
    # timings: on a slow host it went plain and no tree branched
    monkeypatch.setattr(SpecPolicy, "_step_seconds",
                        lambda self, k_max, batch, *rest: [1e-3 * batch * (1 + 0.4 * k) for k in range(k_max + 1)])
    llm = LLM(model=str(tiny_model[0]), use_speculative_decoding=True, speculative_method="ngram",
              spec_policy=policy, spec_length=4, tree_width=3, tree_tokens=10, dtype="float32",
              kv_cache_backend=backend, block_size=4, max_seq_len=200, max_batch_size=8, enable_prefix_caching=True)
    alone = [llm.generate(p, greedy())[0] for p in PROMPTS]
    batched = llm.generate(PROMPTS, greedy())  # the prompts' blocks come from the prefix cache now
    assert [o.token_ids for o in alone] == reference
    assert [o.token_ids for o in batched] == reference
    assert branching["branched"] > 0, branching
    if policy == "fixed":
        assert sum(o.num_accepted_tokens for o in batched) > 0
    assert all(pool.num_used_slots() == 0 for pool in llm.engine.kv.pools().values())


def test_a_live_switch_between_trees_and_chains_keeps_greedy_output(tiny_model, reference, branching):
    llm = LLM(model=str(tiny_model[0]), use_speculative_decoding=True, speculative_method="ngram",
              spec_policy="fixed", spec_length=4, tree_width=3, dtype="float32", max_seq_len=200, max_batch_size=8)
    engine = llm.engine
    ids = [engine.add_request(p, greedy()) for p in PROMPTS]
    widths = iter([1, 3, 1, 3] * 50)
    while engine.has_unfinished_requests():
        engine.step()
        engine.reconfigure_speculation(tree_width=next(widths))
    assert [engine.get_output(i).token_ids for i in ids] == reference
    assert branching["trees"] > 0


class FixedTrees(Proposer):
    """A proposer behind the seam whose every round is the same chosen tree (point masses): the
    two likeliest second tokens, the two likeliest third tokens under the first of them, one
    under the second; `propose` (chains) is the wrapped draft's."""

    name = "fixed_tree"
    drafts_trees = True

    def __init__(self, engine, tree: TokenTree):
        self.inner = engine.speculation.proposer
        self.tree = tree

    def propose(self, requests, ks, with_q) -> Proposal:
        return self.inner.propose(requests, ks, with_q)

    def propose_trees(self, requests, depths, budgets, width):
        return [self.tree if d >= self.tree.depth and b >= len(self.tree) else None for d, b in zip(depths, budgets)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tok_dir):
    """test_spec_statistical's 16-token target and its perturbed copy."""
    tpath, dpath = tmp_path_factory.mktemp("tree_t"), tmp_path_factory.mktemp("tree_d")
    return tpath, dpath, make_pair(tpath, dpath, tok_dir)


def _tree_for(m2, m3) -> TokenTree:
    first, second = (int(i) for i in (-m2).argsort()[:2])
    third = [int(i) for i in (-m3).argsort()[:2]]
    return TokenTree((first, second, third[0], third[1], third[0]), (-1, -1, 0, 0, 1))


@pytest.mark.parametrize("name", ["t1", "t07_topk"])
def test_sampled_trees_match_target_marginals(pair, name):
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS[name])
    m2, m3 = exact_marginals(hf, params)
    tree = _tree_for(m2, m3)
    tokens, acceptance = sample_speculative(tpath, dpath, params, tree_width=3, tree_tokens=8,
                                            proposer=lambda e: FixedTrees(e, tree))
    assert acceptance > 0.05  # some rounds accepted a node
    assert chi2_pvalue(tokens[:, 1], m2) > 1e-3
    assert chi2_pvalue(tokens[:, 2], m3) > 1e-3


def test_teeth_a_tree_rule_without_the_residual_is_detected(pair, monkeypatch):
    monkeypatch.setattr(tree_round, "accept_sampled", no_residual)
    tpath, dpath, hf = pair
    params = SamplingParams(**CONFIGS["t1"])
    m2, m3 = exact_marginals(hf, params)
    tree = _tree_for(m2, m3)
    tokens, _ = sample_speculative(tpath, dpath, params, tree_width=3, tree_tokens=8,
                                   proposer=lambda e: FixedTrees(e, tree))
    assert min(chi2_pvalue(tokens[:, 1], m2), chi2_pvalue(tokens[:, 2], m3)) < 1e-3


def _choice_tree(tok_dir) -> tuple[TokenTree, int]:
    """Branches of the choice grammar's strings, and a forbidden one ("a", cut before the pass)."""
    from engine.tokenizer import Tokenizer

    one, zero, a = (Tokenizer(tok_dir).hf.convert_tokens_to_ids(c) for c in "10a")
    #      root: "1" ("0", "1"), "0" ("1"), "a" ("1")
    return TokenTree((one, zero, a, zero, one, one, one), (-1, -1, -1, 0, 0, 1, 2)), a


@pytest.mark.parametrize("masked", [True, False])
def test_sampled_trees_under_a_grammar_follow_the_masked_target_distribution(tiny_model, tok_dir, monkeypatch,
                                                                              masked):
    """The structured-output test (a choice grammar, every allowed path enumerated) with every
    round a branched tree that includes a forbidden branch. Teeth: with the masks left out of the
    tree pass, outputs leave the grammar."""
    from collections import Counter

    from scipy.stats import chisquare

    from engine.structured_output import StructuredOutput
    from tests.exactness import CHOICES, N, exact_grammar_outcomes

    if not masked:
        monkeypatch.setattr(step_module, "mask_logits", lambda logits, masks: logits)
    tpath, hf = tiny_model
    spec = StructuredOutput.choice(CHOICES)
    prompt = [5, 17, 9, 30]
    expected = exact_grammar_outcomes(hf, tok_dir, prompt, spec, depth=4)
    tree, forbidden = _choice_tree(tok_dir)
    llm = LLM(model=str(tpath), dtype="float32", max_batch_size=64, seed=7, use_speculative_decoding=True,
              speculative_method="ngram", spec_length=2, spec_policy="fixed", tree_width=3, tree_tokens=8)
    llm.engine.speculation.proposer = FixedTrees(llm.engine, tree)
    outs = llm.generate([prompt] * N, SamplingParams(temperature=1.0, max_tokens=4, structured_output=spec))
    seen = Counter(tuple(o.token_ids) for o in outs)
    if not masked:
        assert not set(seen) <= set(expected)
        return
    assert set(seen) <= set(expected) and all(forbidden not in k for k in seen)
    assert sum(o.num_spec_rounds for o in outs) >= N  # rounds were tree rounds, not plain steps
    keys = sorted(expected, key=expected.get, reverse=True)
    big = [k for k in keys if expected[k] * N >= 5]
    f_exp = [expected[k] * N for k in big] + [N * (1 - sum(expected[k] for k in big))]
    f_obs = [seen[k] for k in big] + [N - sum(seen[k] for k in big)]
    if f_exp[-1] < 5:
        f_exp, f_obs = f_exp[:-2] + [f_exp[-2] + f_exp[-1]], f_obs[:-2] + [f_obs[-2] + f_obs[-1]]
    assert len(big) >= 3
    assert chisquare(f_obs, f_exp).pvalue > 1e-3, (f_obs, f_exp)


def test_constrained_greedy_output_is_the_same_with_trees(tiny_model, branching):
    from engine.structured_output import StructuredOutput

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array",
              "items": {"type": "integer"}, "maxItems": 4}}, "required": ["a", "b"]}
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_output=StructuredOutput.json_schema(schema))
    plain = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=200)
    trees = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=200, use_speculative_decoding=True,
                speculative_method="ngram", spec_policy="fixed", spec_length=4, tree_width=3, tree_tokens=10)
    prompts = PROMPTS[:3]
    assert [o.token_ids for o in trees.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    assert branching["trees"] > 0


def test_the_adaptive_policy_takes_trees_only_as_probes_where_they_measure_slower(tiny_model, monkeypatch):
    """Tree rounds measured 100x slower than they ran: after one round of each shape, trees come
    back only as shape_choice's probes (one decision in PROBE_EVERY), with the same greedy output."""
    from collections import Counter

    from engine.speculative.policy import shape_choice
    from engine.speculative.policy.costs import batch_bucket
    from engine.speculative.policy.k_choice import Choice

    rounds: Counter = Counter()  # (batch bucket, tree?) -> rounds
    real_observe = shape_choice.ShapeChoice.observe

    def observe(self, sampled, batch, tree, tokens, seconds):
        rounds[batch_bucket(batch), tree] += 1
        real_observe(self, sampled, batch, tree, tokens, seconds * (100 if tree else 1))

    monkeypatch.setattr(shape_choice.ShapeChoice, "observe", observe)
    # every step speculates (the K choice would follow this host's timings, and plain steps take no shape)
    monkeypatch.setattr(planner_module.RoundPlanner, "_adaptive_choice",
                        lambda self, reqs, caps, running: Choice(4, "adaptive", {}))
    llm = LLM(model=str(tiny_model[0]), use_speculative_decoding=True, speculative_method="ngram",
              spec_policy="adaptive", spec_length=4, tree_width=3, dtype="float32", max_seq_len=256, max_batch_size=8)
    plain = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=256, max_batch_size=8)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(120))] == \
        [o.token_ids for o in plain.generate(PROMPTS, greedy(120))]
    for bucket in {b for b, _ in rounds}:  # the first round, then one probe per PROBE_EVERY decisions
        trees, chains = rounds[bucket, True], rounds[bucket, False]
        assert trees <= 1 + (trees + chains) // shape_choice.PROBE_EVERY, rounds
    assert any(rounds[b, True] >= 2 for b, _ in rounds), rounds  # a probe came



def test_shape_choice_takes_the_faster_shape_and_probes_the_other_ever_less_often():
    from engine.speculative.policy.shape_choice import PROBE_EVERY, ShapeChoice

    choice = ShapeChoice()
    assert choice.take_trees(False, 4)  # nothing measured: a tree first
    choice.observe(False, 4, True, tokens=12, seconds=0.010)  # 1,200 tokens/s
    assert not choice.take_trees(False, 4)  # then a chain
    choice.observe(False, 4, False, tokens=8, seconds=0.010)  # 800 tokens/s
    picks = [choice.take_trees(False, 4) for _ in range(7 * PROBE_EVERY)]
    probes = [i for i, tree in enumerate(picks) if not tree]
    assert probes == [PROBE_EVERY - 1, 3 * PROBE_EVERY - 1, 7 * PROBE_EVERY - 1]  # gaps 16, 32, 64: confirmed
    assert choice.take_trees(True, 4) and choice.take_trees(False, 16)  # sampled batches, other buckets apart
    for _ in range(30):  # trees turn slow: the decayed sums follow, chains win
        choice.observe(False, 4, True, tokens=4, seconds=0.010)
    assert choice.rate(False, 4, True) < choice.rate(False, 4, False)
    picks = [choice.take_trees(False, 4) for _ in range(2 * PROBE_EVERY)]
    assert picks.count(True) == 1 and picks[PROBE_EVERY - 1]  # overturned: probes from every PROBE_EVERY again


def _shapes_taken(choice, difficulty: list[float], tree_factor: float) -> list[bool]:
    """Decode rounds through `choice` at batch 4, greedy: a chain round gives 400 tokens/s times the
    text's difficulty then, a tree round tree_factor times that. The shapes taken, in order."""
    taken = []
    for d in difficulty:
        tree = choice.take_trees(False, 4)
        rate = 400.0 * d * (tree_factor if tree else 1.0)
        choice.observe(False, 4, tree, tokens=4, seconds=4 / rate)
        taken.append(tree)
    return taken


@pytest.mark.parametrize("tree_factor", [0.8, 1.25])
def test_shape_choice_judges_probes_against_the_text_of_their_time(tree_factor, monkeypatch):
    """The losing shape measured at 0.8x (or the winner at 1.25x) the other everywhere: a hard stretch
    of text, halving every rate, switches nothing, though the loser's stale rate is then the higher;
    only its scheduled probes run. Judged by the two recent rates instead, shapes switch there."""
    from engine.speculative.policy.shape_choice import ShapeChoice

    def run(choice) -> tuple[int, int]:
        easy = _shapes_taken(choice, [1.0] * 400, tree_factor)
        hard = _shapes_taken(choice, [0.45] * 64, tree_factor)
        loser = tree_factor < 1
        assert easy[-64:].count(loser) <= 1  # settled on the faster shape: a probe at most
        return hard.count(loser), len(hard)

    losing, rounds = run(ShapeChoice())
    assert losing <= 1 + rounds // 16, losing  # scheduled probes at most (as often as after an overturn)
    choice = ShapeChoice()
    assert choice.tree_over_chain(False, 4) is None
    _shapes_taken(choice, [1.0] * 400, tree_factor)
    assert choice.tree_over_chain(False, 4) == pytest.approx(tree_factor, rel=0.05)

    def by_recent_rates(self, sampled, batch):  # the rule without the probes' ratio
        return self.rate(sampled, batch, True) > self.rate(sampled, batch, False)
    monkeypatch.setattr(ShapeChoice, "trees_faster", by_recent_rates)
    losing_old, _ = run(ShapeChoice())
    assert losing_old >= losing + 3, (losing_old, losing)


def test_tree_width_keeps_the_sibling_ranks_whose_acceptance_pays_for_their_node():
    from engine.speculative.policy.tree_width import EXPLORE_EVERY, RankAcceptance

    ranks = RankAcceptance()
    greedy, sampled = [False], [True]
    assert ranks.width(greedy, 3, node_seconds=0.001, token_seconds=0.01) == 3  # nothing measured: every rank
    #      root: a (rank 0), b (rank 1), c (rank 2); a: d
    tree = TokenTree((1, 2, 3, 4), (-1, -1, -1, 0))
    for i in range(40):  # rank 0 accepted 3 rounds in 4, rank 2 the 4th; rank 1 never
        ranks.observe([False, False], [tree, None], [[0, 3] if i % 4 else [2], []])
    hit = ranks.hit_rates(False)
    assert hit[0] > 0.5 and hit[1] == 0.0 and 0.2 < hit[2] < 0.3 and hit[3] is None
    # a node costing a tenth of a token: rank 2 (hit about 1 in 4) pays, so the width stays 3
    widths = [ranks.width(greedy, 3, node_seconds=0.001, token_seconds=0.01) for _ in range(2 * EXPLORE_EVERY)]
    assert set(widths) == {3}
    # costing half a token: rank 2 does not pay, rank 1 never hits: chains, but for the exploring rounds
    widths = [ranks.width(greedy, 3, node_seconds=0.005, token_seconds=0.01) for _ in range(2 * EXPLORE_EVERY)]
    assert widths.count(3) == 2 and widths.count(1) == 2 * EXPLORE_EVERY - 2
    assert ranks.hit_rates(True) == []  # sampled rows apart: unmeasured, so every rank
    assert ranks.width(sampled, 3, node_seconds=0.005, token_seconds=0.01) == 3
    assert ranks.width(greedy, 3, node_seconds=0.005, token_seconds=None) == 3  # no tree rate yet


def test_tree_width_counts_each_row_by_its_own_kind_and_a_mixed_batch_takes_the_wider():
    from engine.speculative.policy.tree_width import EXPLORE_EVERY, RankAcceptance

    ranks = RankAcceptance()
    tree = TokenTree((1, 2, 3), (-1, -1, -1))  # root: three children, ranks 0-2
    for _ in range(40):  # greedy rows: rank 0 always; sampled rows: rank 1 always
        ranks.observe([False, True], [tree, tree], [[0], [1]])
    greedy, sampled = ranks.hit_rates(False), ranks.hit_rates(True)
    assert greedy[:3] == [1.0, 0.0, 0.0] and sampled[:3] == [0.0, 1.0, 0.0]

    def widths(rows):  # the non-exploring rounds' widths
        out = [ranks.width(rows, 3, node_seconds=0.005, token_seconds=0.01) for _ in range(EXPLORE_EVERY)]
        return set(out) - {3} if out.count(3) == 1 else set(out)
    assert widths([False]) == {1} and widths([True]) == {2} and widths([False, True]) == {2}


def test_a_tree_round_narrowed_to_width_one_runs_as_a_chain_with_the_same_greedy_output(tiny_model, reference,
                                                                                      branching, monkeypatch):
    from engine.speculative.policy.tree_width import RankAcceptance

    monkeypatch.setattr(RankAcceptance, "width", lambda self, *args: 1)
    monkeypatch.setattr(step_module.SpeculativeDecoder, "_take_trees", lambda self, reqs: True)
    llm = LLM(model=str(tiny_model[0]), use_speculative_decoding=True, speculative_method="ngram",
              spec_policy="adaptive", spec_length=4, tree_width=3, dtype="float32", max_seq_len=200, max_batch_size=8)
    outs = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == reference
    assert branching["trees"] == 0 and sum(o.num_accepted_tokens for o in outs) > 0  # chains that accepted


def test_a_k_probe_round_runs_as_a_chain_kept_out_of_the_shape_rates(tiny_model, reference, monkeypatch):
    """Under trees, a round the policy takes at another K to measure it ("k_probe") is a chain of
    that K, and the shape choice does not count it; the greedy output stays plain's."""
    from engine.speculative.policy.k_choice import Choice

    turn = iter(range(10**6))
    monkeypatch.setattr(planner_module.RoundPlanner, "_adaptive_choice",
                        lambda self, reqs, caps, running: Choice(2, "k_probe", {}) if next(turn) % 2 else
                        Choice(4, "policy", {}))
    llm = LLM(model=str(tiny_model[0]), use_speculative_decoding=True, speculative_method="ngram",
              spec_policy="adaptive", spec_length=4, tree_width=3, dtype="float32", max_seq_len=256, max_batch_size=8)
    spec = llm.engine.speculation
    tree_rounds, observed, steps = [], [], []
    real_trees, real_observe, real_decode = spec._decode_trees, spec.shapes.observe, spec.decode

    def decode_trees(reqs, plan, nodes, width):
        tree_rounds.append(plan.reason)
        return real_trees(reqs, plan, nodes, width)

    def observe(sampled, batch, tree, tokens, seconds):
        observed.append(tree)
        real_observe(sampled, batch, tree, tokens, seconds)

    def decode(reqs, running=()):
        result = real_decode(reqs, running)
        steps.append(result.stats)
        return result

    monkeypatch.setattr(spec, "_decode_trees", decode_trees)
    monkeypatch.setattr(spec.shapes, "observe", observe)
    monkeypatch.setattr(spec, "decode", decode)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == reference
    probes = [s for s in steps if s.reason == "k_probe"]
    assert probes and all(max(s.verified_per_round, default=0) <= 2 for s in probes)  # chains of K = 2
    assert tree_rounds and set(tree_rounds) == {"policy"}  # trees only on the policy's own rounds
    assert len(observed) == sum(1 for s in steps if s.reason == "policy" and s.k > 0)  # no probe among them
