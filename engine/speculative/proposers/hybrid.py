"""Hybrid proposals: prompt lookup where it finds a long enough match (strong evidence, no model
pass), the model proposer for the rows it left empty; chains or token trees alike."""

from __future__ import annotations

from engine.request import Request
from engine.speculative.proposers.base import Proposal, Proposer
from engine.speculative.proposers.drafting import trees_for_rows
from engine.token_tree import TokenTree


class HybridProposer(Proposer):
    name = "hybrid"
    runs_model = True

    def __init__(self, lookup: Proposer, model: Proposer):
        self.lookup = lookup
        self.model = model
        self.catch_up = model.catch_up
        self.drafts_trees = lookup.drafts_trees and model.drafts_trees
        self.learns = lookup.learns
        self.target_features = model.target_features

    def learn(self, request: Request) -> None:
        self.lookup.learn(request)

    def propose(self, requests: list[Request], ks: list[int], with_q: bool) -> Proposal:
        found = self.lookup.propose(requests, ks, with_q)
        rest = [i for i, k in enumerate(ks) if k > 0 and not found.tokens[i]]
        if not rest:
            return found
        return found.with_rows(rest, self.model.propose([requests[i] for i in rest], [ks[i] for i in rest], with_q))

    def propose_trees(self, requests: list[Request], depths: list[int], budgets: list[int],
                      width: int) -> list[TokenTree | None]:
        """The lookup's tree where it finds one, the model's for the other rows."""
        found = self.lookup.propose_trees(requests, depths, budgets, width)
        rest = [i for i, (d, b, t) in enumerate(zip(depths, budgets, found)) if d > 0 and b > 0 and not t]
        return trees_for_rows(found, rest, lambda rows: self.model.propose_trees(
            [requests[i] for i in rows], [depths[i] for i in rows], [budgets[i] for i in rows], width))

    @property
    def long_catch_up(self) -> int:
        return self.model.long_catch_up

    def lag(self, requests: list[Request]) -> list[int]:
        return self.model.lag(requests)

    def model_rows(self, requests: list[Request]) -> list[bool]:
        """The requests whose last round the lookup did not propose (a lookup that found a match
        is expected to find one again, with no model pass); a new request's is the model's."""
        return [r.spec.last_proposer != self.lookup.name for r in requests]

    def row_sources(self, requests: list[Request]) -> list[str]:
        return [self.model.name if m else self.lookup.name for m in self.model_rows(requests)]
