"""The EAGLE-3 proposer: a head (a decoder layer or a few) that reads the target's own features.

Head position j holds (target features at position origin + j, embedding of the token after it),
so the head can only consume positions whose next token is known: every position the target has
computed. A round first feeds the features the target's passes left since the last round (the
KV manager's FeatureCache; a prompt, or the 1..K+1 tokens of the last verify) in one pass whose
last output gives the first draft, then steps k - 1 times on its own output (pre-norm, or normed
for a norm_output head). The draft steps' K/V is dropped after the round: the next round feeds
the target's features there instead.
q is the head's distribution over the target vocabulary (0 outside the draft vocabulary), so
exact acceptance is unchanged. A token tree (tree_drafting.py) grows from the same first pass, a
depth per pass, each node fed its parent's output; its K/V goes too, and the target's features of
the accepted path are what the next round feeds (KVManager.keep_paths).
"""

from __future__ import annotations

import functools

import torch

from engine import host_sync
from engine.kv import KVManager
from engine.model.eagle3 import Eagle3Head
from engine.model.passes import at_last, pass_inputs, put_rows, replayed
from engine.request import Request
from engine.speculative.proposers.base import LONG_CATCH_UP, CostObserver, Proposal, Proposer
from engine.speculative.proposers.drafting import (
    catch_up_rows,
    draft_tokens,
    propose_rows,
    token_step_loop,
    trees_for_rows,
)
from engine.speculative.proposers.tree_drafting import draft_trees_then_drop
from engine.token_tree import TokenTree


class EagleProposer(Proposer):
    name = "eagle"
    runs_model = True
    drafts_trees = True
    catch_up = "round"

    def __init__(self, head: Eagle3Head, kv: KVManager, observer: CostObserver):
        self.head = head
        self.kv = kv
        self.observer = observer
        self._round_rows = LONG_CATCH_UP  # the most features the last round left a row (its k + 1)

    @property
    def long_catch_up(self) -> int:
        """A row catching up on no more than its last round's tokens is a steady round (its
        first pass, priced by width); more (plain steps, a lookup's rounds, a new request) is
        caught up on apart."""
        return max(LONG_CATCH_UP, self._round_rows)

    @property
    def features(self):
        return self.kv.features

    @property
    def target_features(self) -> tuple[int, ...]:
        return self.head.aux_layers

    def lag(self, requests: list[Request]) -> list[int]:
        return [self.features.pending(r.request_id) for r in requests]

    def propose(self, requests: list[Request], ks: list[int], with_q: bool) -> Proposal:
        ks = [k if self._ready(r) else 0 for r, k in zip(requests, ks)]
        proposal = propose_rows(requests, ks, self.name, functools.partial(self._draft, with_q=with_q))
        self._round_rows = max(ks, default=0) + 1
        return proposal

    def propose_trees(self, requests: list[Request], depths: list[int], budgets: list[int],
                      width: int) -> list[TokenTree | None]:
        """A tree per request (tree_drafting.py), as `propose` drafts chains: depth at most
        depths[i], at most budgets[i] nodes, for the requests whose features are ready."""
        def draft(rows: list[int]) -> list[TokenTree]:
            reqs = [requests[i] for i in rows]
            logits, hidden = self._catch_up(reqs, [self.kv.draft_len(r) for r in reqs])
            bases = [self.kv.draft_len(r) for r in reqs]  # head positions holding target features
            # [N, 1 + nodes, H]: the outputs of each row's root (column 0) and fed nodes, their children's inputs
            states = hidden.new_zeros(len(reqs), 1 + max(budgets[i] for i in rows), hidden.shape[-1])
            states[:, 0] = hidden
            self._round_rows = max(depths[i] for i in rows) + 1
            return draft_trees_then_drop(self.kv, reqs, bases, [depths[i] for i in rows], [budgets[i] for i in rows],
                                         width, logits, functools.partial(self._feed_tree, reqs, bases, states))

        return trees_for_rows([None] * len(requests), [i for i, (r, d, b) in enumerate(zip(requests, depths, budgets))
                                                       if d > 0 and b > 0 and self._ready(r)], draft)

    def _feed_tree(self, reqs: list[Request], bases: list[int], states: torch.Tensor, rows: list[int],
                   trees: list[TokenTree], counts: list[int]) -> torch.Tensor:
        """One head pass over the newest counts[j] nodes of trees[j] (reqs[rows[j]]'s), each fed its
        parent's output -> their logits [len(rows), W, V]; their outputs go to `states`."""
        done = [len(t) - n for t, n in zip(trees, counts)]  # nodes fed before this pass
        x = pass_inputs(self.head, self.kv.draft, [self.kv.draft_slot(reqs[i]) for i in rows],
                        [list(t.tokens[d:]) for t, d in zip(trees, done)], [bases[i] + d for i, d in zip(rows, done)],
                        trees, [d + 1 for d in done])
        T, P, M = x.ids.shape[1], len(rows) * x.ids.shape[1], sum(counts)
        # each query's state (its parent's column; padding reads the root's), then each fed node's column
        # and its row among the pass's outputs
        reads = [(i, t.parents[d + k] + 1 if k < n else 0) for i, t, d, n in zip(rows, trees, done, counts)
                 for k in range(T)]
        writes = [(i, d + k + 1, j * T + k) for j, (i, d, n) in enumerate(zip(rows, done, counts)) for k in range(n)]
        at = host_sync.upload([a for a, _ in reads] + [b for _, b in reads] + [w[0] for w in writes]
                              + [w[1] for w in writes] + [w[2] for w in writes], states.device, torch.long)  # [2P + 3M]
        hidden = states[at[:P], at[P:2 * P]].view(len(rows), T, -1)  # [R, T, H]
        replay = replayed(self.head, x, hidden)  # a tree kind's graph, else eager
        logits, out = replay or self.head.step(x.ids, x.positions, x.view, hidden, None)  # [R, T, V], [R, T, H]
        states[at[2 * P:2 * P + M], at[2 * P + M:2 * P + 2 * M]] = out.reshape(P, -1)[at[2 * P + 2 * M:]].to(states.dtype)
        return logits[:, :max(counts)]

    def _ready(self, r: Request) -> bool:
        """The features reach the request's last computed position (after capture was off, its next
        target pass starts them again)."""
        return self.features.end(r.request_id) == self.kv.computed(r) and self.features.pending(r.request_id) > 0

    def _draft(self, reqs: list[Request], ks: list[int], with_q: bool) -> tuple[list[list[int]], torch.Tensor | None]:
        lengths = [self.kv.draft_len(r) for r in reqs]  # head positions holding target features
        logits, hidden = self._catch_up(reqs, lengths)
        real = [self.kv.draft_len(r) for r in reqs]
        state = {"hidden": hidden}  # [N, hidden] each row's last output (the state Eagle3Head.step feeds back)
        # the C loop feeds each step's layer output back; a head that feeds its normed output steps in Python
        loop = None if self.head.norm_output else token_step_loop(
            self.head, self.kv.draft, [self.kv.draft_slot(r) for r in reqs], self.head.target_vocab, hidden,
            None if self.head.identity_vocab else self.head.draft_to_target)
        try:
            return draft_tokens(reqs, ks, logits, with_q, functools.partial(self._step, reqs, state), self.observer,
                                loop)
        finally:  # the draft steps' K/V goes: the next round feeds the target's features there
            self.kv.truncate_draft(reqs, real)

    def _catch_up(self, reqs: list[Request], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feeds each request's pending features; its last logits [N, V] and outputs [N, H] (Eagle3Head.step's)."""
        chunks, features, starts = [], [], []
        for r, n in zip(reqs, lengths):
            pending = self.kv.take_features(r)  # propose() checked there are some
            if pending.start - pending.origin != n:  # a new run (capture was off for a while): the head restarts
                self.kv.restart_head(r, pending.start)
                n = 0
            chunks.append(r.all_token_ids[pending.start + 1:pending.start + 1 + pending.rows.shape[0]])
            features.append(pending.rows)
            starts.append(n)
        V, H = self.head.target_vocab, self.head.shape.hidden_size
        logits = torch.empty(len(reqs), V, device=self.head.device)  # [N, V]
        hidden = torch.empty(len(reqs), H, dtype=self.head.dtype, device=self.head.device)  # [N, H]
        catch_up_rows([len(c) for c in chunks],
                      functools.partial(self._feed, reqs, chunks, features, starts, logits, hidden),
                      self.observer, self.head.device, self.long_catch_up)
        return logits, hidden

    def _feed(self, reqs, chunks, features, starts, logits, hidden, rows: list[int]) -> None:
        part_logits, part_hidden = self._pass([reqs[i] for i in rows], [chunks[i] for i in rows],
                                              [features[i] for i in rows], [starts[i] for i in rows])
        put_rows(rows, (logits, part_logits), (hidden, part_hidden))

    def _pass(self, reqs: list[Request], chunks: list[list[int]], hidden: list[torch.Tensor],
              starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends chunks[i] with hidden[i] [n_i, F] at head position starts[i]; last logits and outputs."""
        x = pass_inputs(self.head, self.kv.draft, [self.kv.draft_slot(r) for r in reqs], chunks, starts)
        T = x.ids.shape[1]
        h = torch.zeros(len(reqs), T, hidden[0].shape[-1], dtype=self.head.dtype, device=self.head.device)
        for i, rows in enumerate(hidden):
            h[i, :rows.shape[0]] = rows
        replay = replayed(self.head, x, h)
        if replay is not None:
            return at_last(replay[0], x, False), at_last(replay[1], x, False)
        return self.head.step(x.ids, x.positions, x.view, h, x.last)

    def _step(self, reqs: list[Request], state: dict, rows: list[int], last: list[int]) -> torch.Tensor:
        """One draft step for reqs[rows] from their previous outputs -> logits [len(rows), V]."""
        if len(rows) == state["hidden"].shape[0]:  # every row steps: no index
            logits, state["hidden"] = self._pass_one(reqs, last, state["hidden"][:, None])
            return logits
        index = host_sync.upload(rows, self.head.device, torch.long)  # [n]
        prev = state["hidden"].index_select(0, index)[:, None]  # [n, 1, H]
        logits, out = self._pass_one([reqs[i] for i in rows], last, prev)
        state["hidden"] = state["hidden"].index_copy(0, index, out)
        return logits

    def _pass_one(self, reqs: list[Request], tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = pass_inputs(self.head, self.kv.draft, [self.kv.draft_slot(r) for r in reqs], [[t] for t in tokens],
                        [self.kv.draft_len(r) for r in reqs])
        replay = replayed(self.head, x, hidden)
        if replay is not None:
            return replay[0][:, 0], replay[1][:, 0]
        return self.head.step(x.ids, x.positions, x.view, hidden, x.last)

