"""What the adaptive policy prices is what will run: the proposer declares which rows a model
drafts (`Proposer.model_rows`, overridden by hybrid), and the step reads that, never its type."""

from __future__ import annotations

import re
from types import SimpleNamespace

from engine.config import SpecConfig
from engine.request import SpecStats
from engine.speculative.proposers.base import Proposer
from engine.speculative.proposers.hybrid import HybridProposer
from engine.speculative.proposers.ngram import NgramProposer
from engine.speculative.step import SpeculativeDecoder
from tests.helpers import REPO

PLAIN_S, VERIFY_TOKEN_S, DRAFT_ROW_S, CATCH_UP_TOKEN_S = 10e-3, 0.1e-3, 2e-3, 1e-4


class Model(Proposer):
    """A model proposer's declarations, no passes; its lag by request id (0 if not given)."""

    name = "model"
    runs_model = True

    def __init__(self, lags: dict[str, int] | None = None):
        self.lags = lags or {}

    def lag(self, requests):
        return [self.lags.get(r.request_id, 0) for r in requests]


class ScriptedCosts:
    """A step's prices, scripted: a verify pass PLAIN_S plus VERIFY_TOKEN_S a proposed token, a
    draft pass DRAFT_ROW_S a row drafted, a catch-up CATCH_UP_TOKEN_S a token, nothing else; it
    counts the rows and the catch-up tokens it was asked to price."""

    packed: dict = {}

    def __init__(self):
        self.draft_rows: list[int] = []
        self.catch_up_tokens: list[int] = []

    def verify_times(self, batch, k_max):
        return [PLAIN_S + VERIFY_TOKEN_S * batch * k for k in range(k_max + 1)]

    def other_times(self, batch, k_max):
        return [0.0] * (k_max + 1)

    def draft_times(self, rows, k_max):
        self.draft_rows.append(rows)
        one = DRAFT_ROW_S * rows
        return [one] * (k_max + 1), [n * one for n in range(max(k_max, 1))]

    def catch_up_time(self, tokens):
        self.catch_up_tokens.append(tokens)
        return CATCH_UP_TOKEN_S * tokens

    def observe_target(self, *args):
        pass


def _request(last_proposer: str | None, rid: str = "r") -> SimpleNamespace:
    params = SimpleNamespace(max_tokens=1000, spec_length=None, greedy=True)
    return SimpleNamespace(request_id=rid, spec=SpecStats(last_proposer=last_proposer), num_tokens=10,
                           output_token_ids=[1], params=params)


def _hybrid_decoder(lags: dict[str, int] | None = None, **settings) -> tuple[SpeculativeDecoder, ScriptedCosts]:
    """A decoder over `hybrid` (prompt lookup, else Model) at scripted prices, no model passes."""
    costs = ScriptedCosts()
    runner = SimpleNamespace(capture=(), model=SimpleNamespace(graphs=None))
    kv = SimpleNamespace(features=None, target=SimpleNamespace(max_seq_len=1000), drop_features=lambda: None)
    config = SpecConfig(speculative_method="ngram", spec_policy="adaptive", spec_length=4, **settings)
    decoder = SpeculativeDecoder(runner, kv, config, SimpleNamespace(vocab_size=16, device="cpu"), costs)
    decoder.proposer = HybridProposer(NgramProposer(16, "cpu", 4, 1, 2), Model(lags))
    return decoder, costs


def _batch(model_rows: int, size: int = 8) -> list[SimpleNamespace]:
    """`size` requests: the first `model_rows` the model proposed for last, the rest the lookup."""
    return [_request("model" if i < model_rows else "ngram", f"r{i}") for i in range(size)]


def test_the_proposer_declares_the_rows_a_model_drafts():
    reqs = [_request(p) for p in (None, "ngram", "model", "ngram")]
    lookup = NgramProposer(16, "cpu", 4, 1, 2)
    assert Model().model_rows(reqs) == [True] * 4
    assert lookup.model_rows(reqs) == [False] * 4
    # hybrid: the rows whose last round its lookup did not propose (a new request's too)
    assert HybridProposer(lookup, Model()).model_rows(reqs) == [True, False, True, False]


def test_the_step_reads_no_proposer_by_its_type():
    found = [f"{path.relative_to(REPO)}:{n}" for path in (REPO / "engine" / "speculative").rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"getattr\([^)]*proposer|isinstance\([^)]*Proposer\)", line)]
    assert not found, found


def test_one_k_drafting_is_priced_for_the_rows_the_model_drafts():
    """Hybrid's lookup rows run no draft pass: a batch of 8 with 2 model rows prices drafting at 2
    rows, and at these prices speculates (K = 1: 12.8 tokens in 14.8 ms against 8 in 10 ms); with
    all 8 rows the model's, drafting costs 4x as much and the batch decodes plainly."""
    decoder, costs = _hybrid_decoder()
    reqs = _batch(2)
    choice = decoder.planner._adaptive_choice(reqs, [4] * 8, reqs)
    assert set(costs.draft_rows) == {2} and choice.k == 1
    decoder, costs = _hybrid_decoder()
    reqs = _batch(8)
    choice = decoder.planner._adaptive_choice(reqs, [4] * 8, reqs)
    assert set(costs.draft_rows) == {8} and choice.k == 0
    decoder, costs = _hybrid_decoder()
    reqs = _batch(0)  # every row the lookup's: no draft priced at all
    assert decoder.planner._adaptive_choice(reqs, [4] * 8, reqs).k > 0 and costs.draft_rows == []


def _one_k_catch_up(decoder: SpeculativeDecoder, reqs: list) -> int:
    """The catch-up tokens the one-K choice is priced with."""
    priced, choose = [], decoder.planner.policy.choose
    decoder.planner.policy.choose = lambda *args: priced.append(args[3]) or choose(*args)
    decoder.planner._adaptive_choice(reqs, [4] * len(reqs), reqs)
    return priced[0]


def test_a_catch_up_is_charged_for_the_rows_the_model_drafts_only():
    """Rows the lookup serves never feed the model, so their lag grows: it is not charged. Row 0
    (the model's) lags 50 tokens, the lookup's rows 500 each; one K and per-request price 50."""
    lags = {"r0": 50} | {f"r{i}": 500 for i in range(2, 8)}
    decoder, costs = _hybrid_decoder(lags)
    assert _one_k_catch_up(decoder, _batch(2)) == 50 and set(costs.catch_up_tokens) == {50}
    decoder, costs = _hybrid_decoder(lags, k_per_request=True)
    decoder.planner._per_request_plan(_batch(2), [4] * 8)
    assert costs.catch_up_tokens == [50]
    decoder, costs = _hybrid_decoder(lags)  # no row the model's: nothing to catch up on
    assert _one_k_catch_up(decoder, _batch(0)) == 0 and costs.catch_up_tokens == []


def test_each_row_is_priced_at_the_acceptance_of_the_proposer_it_will_take():
    """Hybrid's lookup rounds (all accepted) and model rounds (none) are kept apart: a new
    request the lookup serves is priced near the lookup's rate, one the model drafts near the
    model's, where one pool for both would price both at the mix."""
    decoder, _ = _hybrid_decoder()
    for step in range(40):
        decoder.planner.acceptance.update(f"old{step % 4}", 4, 4, ("ngram", False))
        decoder.planner.acceptance.update(f"old{4 + step % 4}", 0, 4, ("model", False))
        decoder.planner.acceptance.end_step()
    lookup_row, model_row = decoder.planner._rates([_request("ngram", "new0"), _request("model", "new1")], 4)
    assert min(lookup_row) > 0.9 and model_row[0] < 0.1  # (the model's later positions never judged)
    mixed = decoder.planner.acceptance.rates(["new2"], 4)[0]  # no key: all rounds together
    assert 0.3 < mixed[0] < 0.7
