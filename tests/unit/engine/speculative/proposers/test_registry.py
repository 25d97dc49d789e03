"""The proposer registry, and docs/contributing.md's recipe "Add a proposer" run as written: a toy
proposer registered from this file alone (no edit to the engine) becomes a speculative_method,
speculates with its declared capabilities, and its greedy output is the target's own."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.config import SpecConfig
from engine.speculative.proposers.base import Proposal, Proposer, one_hot_q
from engine.speculative.proposers.registry import register_proposer
from engine.token_tree import TokenTree
from tests.helpers import greedy

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "x = 1\nx = 1\nx ="]


class RepeatLast(Proposer):
    """Proposes the request's last token again, k times (a point mass), and as a tree its last two
    tokens as siblings; learns how many requests finished."""

    name = "repeat_last"
    drafts_trees = True
    learns = True

    def __init__(self, vocab_size: int, device):
        self.vocab_size, self.device = vocab_size, device
        self.finished = 0

    def propose(self, requests, ks, with_q) -> Proposal:
        tokens = [[r.all_token_ids[-1]] * k for r, k in zip(requests, ks)]
        return Proposal(tokens, one_hot_q(tokens, self.vocab_size, self.device) if with_q else None,
                        [self.name if t else "none" for t in tokens])

    def propose_trees(self, requests, depths, budgets, width):
        return [TokenTree((r.all_token_ids[-1], r.all_token_ids[-2]), (-1, -1)) if d and b >= 2 else None
                for r, d, b in zip(requests, depths, budgets)]

    def learn(self, request) -> None:
        self.finished += 1


@pytest.fixture(scope="module")
def toy():
    made = []

    def factory(settings, sources):
        made.append(RepeatLast(sources.vocab_size, sources.device))
        return made[-1]

    register_proposer("repeat_last", factory)
    return made


def test_a_proposer_registered_from_a_test_speculates_exactly(tiny_model, toy):
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        SpecConfig(speculative_method="repeat_lest")
    plain = [o.token_ids for o in LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=128).generate(
        PROMPTS, greedy(24))]
    for trees in (1, 3):
        llm = LLM(model=str(tiny_model[0]), speculative_method="repeat_last", spec_policy="fixed", spec_length=3,
                  tree_width=trees, dtype="float32", max_seq_len=128)
        outs = llm.generate(PROMPTS, greedy(24))
        assert [o.token_ids for o in outs] == plain
        assert sum(o.num_spec_rounds for o in outs) > 0 and {p for o in outs for p in o.proposers} == {"repeat_last"}
        assert toy[-1].finished == len(PROMPTS)  # `learns`: told of every finished request


def test_a_method_the_registry_does_not_know_is_refused_by_name():
    with pytest.raises(ValueError, match=r"speculative_method must be one of \[.*'ngram'.*\], got 'medusa'"):
        SpecConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="non-empty string"):
        register_proposer("", lambda s, src: None)
