"""The draft-model proposer: batched draft forwards, keeping the adjusted distribution q.

Draft KV fills lazily in the draft pool: each round first catches up on the tokens the draft has
not seen (a prompt, one or two in steady state) in one pass whose last logits give q_1, then
k - 1 one-token steps; each part's time goes to the cost model through the observer. A token
tree (tree_drafting.py) grows from the same catch-up, a depth per pass; its K/V is dropped after.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.kv import KVManager
from engine.model.passes import forward_chunks, put_rows
from engine.model.transformer import Transformer
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
from engine.tokenizer import Tokenizer


def check_compatible(target_tok: Tokenizer, draft_tok: Tokenizer, target_name: str, draft_name: str) -> None:
    """A draft, of any family, must speak the target's vocabulary: the same tokens with the same ids
    and the same EOS ids. Embedding sizes may differ (rows of padding: Qwen2.5-7B has 152,064 where
    0.5B has 151,936); the proposer works in the target's."""
    problems = []
    if target_tok.hf.get_vocab() != draft_tok.hf.get_vocab():
        problems.append(f"their tokenizers differ ({target_tok.vocab_size} vs {draft_tok.vocab_size} tokens"
                        f"{', the same number with other ids' if target_tok.vocab_size == draft_tok.vocab_size else ''})")
    if target_tok.eos_token_ids != draft_tok.eos_token_ids:
        problems.append(f"EOS ids {sorted(target_tok.eos_token_ids)} vs {sorted(draft_tok.eos_token_ids)}")
    if problems:
        raise ValueError(f"draft model {draft_name} is not compatible with target model {target_name}: "
                         + "; ".join(problems))


class DraftModelProposer(Proposer):
    name = "draft"
    runs_model = True
    drafts_trees = True
    catch_up = "own"

    def __init__(self, model: Transformer, kv: KVManager, observer: CostObserver, vocab_size: int):
        self.model = model
        self.kv = kv
        self.observer = observer
        self.vocab_size = vocab_size  # the target's: draft logits are cut or padded to it
        self._round_rows = LONG_CATCH_UP  # the most tokens the last round left a row to catch up on

    @property
    def long_catch_up(self) -> int:
        """A row catching up on no more than its last round left it is a steady round: 1 or 2
        tokens after a chain round, the accepted path and the final token after a tree round."""
        return max(LONG_CATCH_UP, self._round_rows)

    def _forward(self, rows: list[Request], chunks: list[list[int]], starts: list[int],
                 trees: list[TokenTree] | None = None, tree_from: list[int] | None = None) -> torch.Tensor:
        """The draft's last logits for each row's chunk, over the target's vocabulary [N, V]; or
        with trees (a drafting pass over their newest nodes, passes.pass_inputs) every
        position's [N, T, V]."""
        if self.model.shape.vocab_size < self.vocab_size:  # an id past the draft's rows (padding) reads row 0
            chunks = [[t if t < self.model.shape.vocab_size else 0 for t in c] for c in chunks]
        logits = forward_chunks(self.model, self.kv.draft, [self.kv.draft_slot(r) for r in rows], chunks, starts,
                                all_logits=trees is not None, trees=trees, tree_from=tree_from)
        extra = self.vocab_size - logits.shape[-1]  # ids the draft has no row for get probability 0
        return logits[..., :self.vocab_size] if extra <= 0 else F.pad(logits, (0, extra), value=float("-inf"))

    def lag(self, requests: list[Request]) -> list[int]:
        return [r.num_tokens - self.kv.draft_len(r) for r in requests]

    def propose(self, requests: list[Request], ks: list[int], with_q: bool) -> Proposal:
        proposal = propose_rows(requests, ks, self.name, lambda reqs, row_ks: draft_tokens(
            reqs, row_ks, self._catch_up(reqs), with_q, functools.partial(self._step, reqs), self.observer,
            token_step_loop(self.model, self.kv.draft, [self.kv.draft_slot(r) for r in reqs], self.vocab_size,
                            candidates=min(self.vocab_size, self.model.shape.vocab_size))))
        self._round_rows = LONG_CATCH_UP
        return proposal

    def propose_trees(self, requests: list[Request], depths: list[int], budgets: list[int],
                      width: int) -> list[TokenTree | None]:
        """A tree per request (tree_drafting.py): depth at most depths[i], at most budgets[i] nodes."""
        def draft(rows: list[int]) -> list[TokenTree]:
            reqs = [requests[i] for i in rows]
            logits = self._catch_up(reqs)
            bases = [self.kv.draft_len(r) for r in reqs]  # each row's first tree node goes here
            self._round_rows = max(depths[i] for i in rows) + 1
            return draft_trees_then_drop(self.kv, reqs, bases, [depths[i] for i in rows], [budgets[i] for i in rows],
                                         width, logits, functools.partial(self._feed_tree, reqs, bases))

        return trees_for_rows([None] * len(requests), [i for i, (d, b) in enumerate(zip(depths, budgets))
                                                       if d > 0 and b > 0], draft)

    def _feed_tree(self, reqs: list[Request], bases: list[int], rows: list[int], trees: list[TokenTree],
                   counts: list[int]) -> torch.Tensor:
        """One drafting pass over the newest counts[j] nodes of trees[j] (reqs[rows[j]]'s) -> their
        logits [len(rows), W, V]."""
        done = [len(t) - n for t, n in zip(trees, counts)]  # nodes fed before this pass
        return self._forward([reqs[i] for i in rows], [list(t.tokens[d:]) for t, d in zip(trees, done)],
                             [bases[i] + d for i, d in zip(rows, done)], trees, [d + 1 for d in done])

    def _catch_up(self, reqs: list[Request]) -> torch.Tensor:
        """Feeds each request's unseen tokens (long runs apart from short ones); returns the
        logits [N, V] at each request's last token."""
        starts = [self.kv.draft_len(r) for r in reqs]
        chunks = [r.all_token_ids[n:] for r, n in zip(reqs, starts)]
        logits = torch.empty(len(reqs), self.vocab_size, device=self.model.device)  # [N, V]
        catch_up_rows([len(c) for c in chunks], functools.partial(self._feed, reqs, chunks, starts, logits),
                      self.observer, self.model.device, self.long_catch_up)
        return logits

    def _feed(self, reqs: list[Request], chunks: list[list[int]], starts: list[int], logits: torch.Tensor,
              rows: list[int]) -> None:
        put_rows(rows, (logits, self._forward([reqs[i] for i in rows], [chunks[i] for i in rows],
                                              [starts[i] for i in rows])))

    def _step(self, reqs: list[Request], rows: list[int], last: list[int]) -> torch.Tensor:
        """One-token draft passes for reqs[rows] -> their logits [len(rows), V]."""
        return self._forward([reqs[i] for i in rows], [[t] for t in last], [self.kv.draft_len(reqs[i]) for i in rows])
