"""Hybrid proposals: prompt lookup where it finds a long enough match (strong evidence, no model
pass), the model proposer for the rows it left empty."""

from __future__ import annotations

from engine.request import Request
from engine.speculative.proposer import Proposal, Proposer


class HybridProposer:
    name = "hybrid"
    runs_model = True

    def __init__(self, lookup: Proposer, model: Proposer):
        self.lookup = lookup
        self.model = model
        self.catch_up = model.catch_up

    def propose(self, requests: list[Request], ks: list[int], with_q: bool) -> Proposal:
        found = self.lookup.propose(requests, ks, with_q)
        rest = [i for i, k in enumerate(ks) if k > 0 and not found.tokens[i]]
        if not rest:
            return found
        return found.with_rows(rest, self.model.propose([requests[i] for i in rest], [ks[i] for i in rest], with_q))

    @property
    def long_catch_up(self) -> int:
        return self.model.long_catch_up

    def lag(self, requests: list[Request]) -> list[int]:
        return self.model.lag(requests)

