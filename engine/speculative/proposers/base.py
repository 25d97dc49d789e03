"""The Proposer seam: anything that guesses the next tokens of a batch of requests, with the
distribution q each was drawn from (a model's, or one-hot). Exact acceptance needs only that the
token was drawn from q; q's quality decides speed, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from engine import host_sync
from engine.request import Request
from engine.token_tree import TokenTree

LONG_CATCH_UP = 4  # a draft model more than this many tokens behind feeds them in a prefill-like pass

# What a model proposer's first pass of a round feeds each row in steady state: every token the
# last round produced ("round": an EAGLE head, which reads the target's features of them, a + 1
# tokens) or only those it did not draft itself ("own": a draft model, 1 token, 2 after a full
# acceptance). The policy prices the first pass by the width this implies for each K.
CatchUp = Literal["round", "own"]


@dataclass
class Proposal:
    """Proposed tokens for a batch and the distributions they were drawn from."""

    tokens: list[list[int]]  # tokens[i]: the (0..ks[i]) tokens proposed for request i
    q: torch.Tensor | None  # [N, K, V] q of each proposed token (K = longest proposal); None unless asked
    sources: list[str]  # the proposer of row i ("none" where it proposed nothing)

    @property
    def k_max(self) -> int:
        return max((len(t) for t in self.tokens), default=0)

    def with_rows(self, rows: list[int], part: Proposal) -> Proposal:
        """This proposal with rows[j] replaced by part's row j (q of both, when both have it)."""
        tokens, sources = list(self.tokens), list(self.sources)
        for j, i in enumerate(rows):
            tokens[i], sources[i] = part.tokens[j], part.sources[j]
        q = None
        if self.q is not None and part.q is not None:
            n, _, vocab = self.q.shape
            q = self.q.new_zeros(n, max(self.q.shape[1], part.q.shape[1]), vocab)  # [N, K, V]
            q[:, :self.q.shape[1]] = self.q
            index = host_sync.upload(rows, q.device, torch.long)  # [len(rows)]
            q.index_fill_(0, index, 0.0)
            q[:, :part.q.shape[1]].index_copy_(0, index, part.q.to(q.dtype))
        return Proposal(tokens, q, sources)


def one_hot_q(tokens: list[list[int]], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[N, K, V] q of a model-free proposer: 1 at each proposed token (rows padded with zeros)."""
    q = torch.zeros(len(tokens), max(1, max((len(t) for t in tokens), default=0)), vocab, device=device)
    ones = [(i, j, token) for i, t in enumerate(tokens) for j, token in enumerate(t)]
    if ones:
        at = host_sync.upload(list(zip(*ones)), device, torch.long)  # [3, n]: row, position, token
        q[at[0], at[1], at[2]] = 1.0
    return q


class Proposer:
    """Anything that proposes: a model-free lookup or a model's drafts. A proposer declares what
    it does beyond `propose` by its class attributes and methods (`lag`, `model_rows`), and the
    round reads those, never its type:
    - drafts_trees: `propose_trees` gives token trees (else every round is a chain);
    - learns: `learn` stores a finished request's output for later proposals (suffix decoding);
    - target_features: the target layers whose inputs it reads (an EAGLE-3 head's): the target's
      passes keep them while it proposes."""

    name: str = "proposer"
    runs_model: bool = False  # proposing runs model passes (the policy prices them); False: a lookup
    catch_up: CatchUp = "own"  # what its first pass of a round feeds (for a lookup: "own", never priced)
    # rows with more tokens than this to catch up on are fed in prefill-like passes before the
    # round's first pass, priced apart (the policy's catch_up_tokens); fewer is a steady round
    long_catch_up: int = LONG_CATCH_UP
    drafts_trees: bool = False
    learns: bool = False
    target_features: tuple[int, ...] = ()

    def propose(self, requests: list[Request], ks: list[int], with_q: bool) -> Proposal:
        """Up to ks[i] tokens for requests[i] (ks[i] may be 0); q [N, K, V] when with_q."""
        raise NotImplementedError

    def propose_trees(self, requests: list[Request], depths: list[int], budgets: list[int],
                      width: int) -> list[TokenTree | None]:
        """A tree for each request, of depth at most depths[i], budgets[i] nodes, `width` children
        a node (drafts_trees)."""
        raise NotImplementedError(f"the {self.name} proposer drafts no trees")

    def learn(self, request: Request) -> None:
        """A finished request's output informs later proposals (learns)."""
        raise NotImplementedError(f"the {self.name} proposer learns nothing")

    def lag(self, requests: list[Request]) -> list[int]:
        """Tokens each request's proposer state must catch up on before it can propose (0 for
        a stateless proposer)."""
        return [0] * len(requests)

    def model_rows(self, requests: list[Request]) -> list[bool]:
        """Which requests a model would draft for if they propose this round (the policy prices
        their draft passes and catch-ups, and no others'): every one for a model proposer
        (runs_model), none for a lookup."""
        return [self.runs_model] * len(requests)

    def row_sources(self, requests: list[Request]) -> list[str]:
        """The name each request's proposals would come from this round (Proposal.sources'
        names): the policy keeps acceptance apart by it."""
        return [self.name] * len(requests)


class CostObserver(Protocol):
    """Where proposers and the step report what their passes took."""

    def observe_target(self, batch: int, tokens_per_seq: int, seconds: float) -> None: ...
    def observe_draft_first(self, batch: int, width: int, seconds: float) -> None: ...
    def observe_draft_steps(self, batch: int, steps: int, seconds: float) -> None: ...
    def observe_catch_up(self, tokens: int, seconds: float) -> None: ...
