"""The autoregressive drafting loop model proposers share: from each row's first logits, draw a
token (greedy, or from the request's adjusted distribution, keeping q), walk the row's grammar,
and step the rows that still need tokens, until each row has its k.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine import host_sync
from engine.grammar import GrammarMatcher, mask_rows
from engine.kv import CachePool
from engine.model.passes import pass_inputs, width_groups
from engine.model.transformer import Transformer
from engine.request import Request
from engine.sampling import Adjustments, SamplingRows, adjusted_probs, draw
from engine.speculative.proposers.base import LONG_CATCH_UP, CostObserver, Proposal
from engine.uniforms import draw_uniforms

# rows still drafting (indices into the batch), their last tokens -> their next logits [len(rows), V]
StepFn = Callable[[list[int], list[int]], torch.Tensor]
# each row's first token, steps, the rows' temperatures [N] and uniforms [N, steps] (None: greedy) ->
# `steps` tokens after it for every row, and their q over the target vocabulary [N, steps, V] (None
# when greedy), all in one call
LoopFn = Callable[[list[int], int, torch.Tensor | None, torch.Tensor | None],
                  tuple[list[list[int]], torch.Tensor | None]]


def propose_rows(requests: list[Request], ks: list[int], name: str,
                 draft: Callable[[list[Request], list[int]], tuple[list[list[int]], torch.Tensor | None]]) -> Proposal:
    """A Proposal for the rows with ks[i] > 0 drafted by `draft(reqs, ks) -> (tokens, q)`, the
    other rows empty."""
    rows = [i for i, k in enumerate(ks) if k > 0]
    if not rows:
        return Proposal([[] for _ in requests], None, ["none"] * len(requests))
    tokens, q = draft([requests[i] for i in rows], [ks[i] for i in rows])
    part = Proposal(tokens, q, [name] * len(rows))
    if len(rows) == len(requests):
        return part
    empty = q.new_zeros(len(requests), 1, q.shape[-1]) if q is not None else None  # [N, 1, V]
    return Proposal([[] for _ in requests], empty, ["none"] * len(requests)).with_rows(rows, part)


def trees_for_rows(base: list, rows: list[int], draft: Callable[[list[int]], list]) -> list:
    """A copy of `base` with `draft(rows)`'s i-th result at rows[i] (nothing drafted when rows is
    empty)."""
    out = list(base)
    if rows:
        for i, tree in zip(rows, draft(rows)):
            out[i] = tree
    return out


def token_step_loop(model: Transformer, pool: CachePool, slots: list[int], vocab: int, hidden: torch.Tensor | None = None,
                    draft_to_target: torch.Tensor | None = None, candidates: int | None = None) -> LoopFn | None:
    """Drafting in one C call a round on `model`'s token step, each slot stepping from its current
    length (see TokenStep.draft for draft_to_target and candidates; hidden [N, hidden], an EAGLE-3
    head's state, in any dtype); q is mapped into the target's `vocab` ids. None where it does not
    run (no token step, more rows than it takes). Nothing is prepared until the call."""
    step = model.token_step
    if step is None or len(slots) > step.max_rows:
        return None

    def run(first: list[int], steps: int, temperatures: torch.Tensor | None,
            uniforms: torch.Tensor | None) -> tuple[list[list[int]], torch.Tensor | None]:
        starts = [pool.seq_len(s) for s in slots]
        x = pass_inputs(model, pool, slots, [[t] * steps for t in first], starts)
        state = None if hidden is None else hidden.to(torch.float32).contiguous()  # [N, hidden], stepped in place
        tokens, q_draft = step.draft(first, x.view, starts, steps, state, draft_to_target, candidates,
                                     temperatures, uniforms)  # q_draft [N, steps, candidates]
        if q_draft is None:
            return tokens, None
        q = q_draft.new_zeros(len(first), steps, vocab)  # [N, steps, V]
        if draft_to_target is None:
            q[..., :q_draft.shape[-1]] = q_draft
        else:
            q.index_copy_(-1, draft_to_target, q_draft)
        return tokens, q
    return run


def catch_up_rows(lengths: list[int], feed: Callable[[list[int]], None], observer: CostObserver,
                  device: torch.device, long_after: int = LONG_CATCH_UP) -> None:
    """Runs feed(rows) over every row: rows with more than `long_after` tokens to catch up on in
    prefill-like passes grouped by width (bounded padding), the others in one pass; each part's
    time goes to the observer."""
    long_rows = [i for i, n in enumerate(lengths) if n > long_after]
    short_rows = [i for i, n in enumerate(lengths) if n <= long_after]
    t0 = t1 = time.perf_counter()
    if long_rows:
        for group in width_groups([lengths[i] for i in long_rows]):
            feed([long_rows[g] for g in group])
        host_sync.wait(device)  # no read follows: the clock must see the device's work
        t1 = time.perf_counter()
        observer.observe_catch_up(sum(lengths[i] for i in long_rows), t1 - t0)
    if short_rows:
        feed(short_rows)
        host_sync.wait(device)
        observer.observe_draft_first(len(short_rows), max(lengths[i] for i in short_rows), time.perf_counter() - t1)


def draft_tokens(reqs: list[Request], ks: list[int], logits: torch.Tensor, with_q: bool, step: StepFn,
                 observer: CostObserver, loop: LoopFn | None = None) -> tuple[list[list[int]], torch.Tensor | None]:
    """ks[i] tokens for reqs[i]: the first from `logits` [N, V], the rest from `step`, or all at
    once from `loop` (when the proposer has one for these rows) if no row follows a grammar and
    each row is greedy or samples at a temperature alone; with q [N, max(ks), V] when with_q. A
    request with a grammar drafts only tokens it allows (its matcher walks ahead and is rolled
    back after). The steps' time goes to the observer."""
    sampling = _Sampling(reqs, logits.shape[-1], logits.device) if with_q else None
    if loop is not None and all(r.grammar is None for r in reqs) and (sampling is None or sampling.rows.temperature_only):
        return _draft_in_one_call(reqs, ks, logits, sampling, loop, observer)
    tokens: list[list[int]] = [[] for _ in reqs]
    grammars = [r.grammar for r in reqs]
    walked = [0] * len(reqs)  # tokens each grammar accepted ahead of its request
    active = list(range(len(reqs)))
    steps, t0 = 0, time.perf_counter()
    try:
        while True:
            logits, stuck = _masked(logits, [grammars[i] if i in active else None for i in range(len(reqs))])
            drawn = logits.argmax(dim=-1) if sampling is None else sampling.draw(logits, active)  # [N]
            drawn = host_sync.read(drawn if stuck is None else drawn.masked_fill(stuck, -1))
            if stuck is not None:
                active = [i for i in active if drawn[i] >= 0]
            for i in active:
                tokens[i].append(drawn[i])
            active = [i for i in active if len(tokens[i]) < ks[i] and _walk(grammars[i], drawn[i], walked, i)]
            if not active:
                break
            step_logits = step(active, [tokens[i][-1] for i in active])
            if len(active) < len(reqs):  # only the requests that still need tokens step
                rows = host_sync.upload(active, logits.device, torch.int64)  # [len(active)]
                step_logits = logits.clone().index_copy_(0, rows, step_logits)
            logits, steps = step_logits, steps + 1
    finally:
        for g, n in zip(grammars, walked):
            if g is not None:
                g.rollback(n)
    if steps:
        observer.observe_draft_steps(len(reqs), steps, time.perf_counter() - t0)
    return tokens, None if sampling is None else torch.stack(sampling.q_steps, dim=1)


def _draft_in_one_call(reqs: list[Request], ks: list[int], logits: torch.Tensor, sampling: _Sampling | None,
                       loop: LoopFn, observer: CostObserver) -> tuple[list[list[int]], torch.Tensor | None]:
    """draft_tokens' rounds whose steps after the first run in one `loop` call: the first token
    from `logits` [N, V] (greedy, or drawn by `sampling` keeping q), then max(ks) - 1 more a row."""
    first = host_sync.read(logits.argmax(dim=-1) if sampling is None else sampling.draw(logits, list(range(len(reqs)))))
    steps, temperatures, uniforms = max(ks) - 1, None, None
    if sampling is not None and steps:
        temperatures = sampling.rows.temperature.masked_fill(sampling.rows.greedy, 0.0).cpu()  # [N], 0: greedy
        # [N, steps] on the host, where the loop runs: a sampled row's first k - 1 from its stream, the rest unused
        uniforms = draw_uniforms([r.random_stream for r in reqs], steps, "cpu",
                                 counts=[0 if r.params.greedy else max(k - 1, 0) for r, k in zip(reqs, ks)])
    more, q_more = [[] for _ in reqs], None
    if steps:
        t0 = time.perf_counter()
        more, q_more = loop(first, steps, temperatures, uniforms)
        observer.observe_draft_steps(len(reqs), steps, time.perf_counter() - t0)
    tokens = [([t] + rest)[:k] for t, rest, k in zip(first, more, ks)]
    if sampling is None:
        return tokens, None
    q_first = sampling.q_steps[0][:, None]  # [N, 1, V]
    return tokens, q_first if q_more is None else torch.cat([q_first, q_more.to(q_first.device)], dim=1)


def _masked(logits: torch.Tensor, grammars: list[GrammarMatcher | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V] under the rows' grammars, and which rows [N] have no token left the proposer can
    propose (a reduced draft vocabulary the grammar excludes): those stop drafting; their logits
    become finite so their discarded draw stays a number."""
    masked = mask_rows(logits, grammars)
    if masked is logits:
        return logits, None
    stuck = ~masked.isfinite().any(dim=-1)  # [N]
    return masked.masked_fill(stuck[:, None], 0.0), stuck


def _walk(grammar: GrammarMatcher | None, token: int, walked: list[int], row: int) -> bool:
    """Advances a row's grammar past its drafted token; whether the row may draft on."""
    if grammar is None:
        return True
    if not grammar.accept(token):
        return False
    walked[row] += 1
    return not grammar.terminated


class _Sampling:
    """Draws draft tokens from each request's adjusted distribution, keeping every q."""

    def __init__(self, reqs: list[Request], vocab_size: int, device: torch.device):
        self.reqs = reqs
        params = [r.params for r in reqs]
        self.rows = SamplingRows.build(params, device)
        # q is adjusted as p is (sampling.py): the same penalties and bias, over the same context
        self.adjust = Adjustments.build(self.rows, params, [r.all_token_ids for r in reqs],
                                        [r.output_token_ids for r in reqs], vocab_size, device)
        self.q_steps: list[torch.Tensor] = []  # [N, V] per step

    def draw(self, logits: torch.Tensor, active: list[int]) -> torch.Tensor:
        q = adjusted_probs(logits, self.rows, self.adjust)  # [N, V]
        self.q_steps.append(q)
        drawn = draw(q, [r.params for r in self.reqs], [r.random_stream for r in self.reqs], active)  # [N]
        if self.adjust is not None:
            self.adjust.add_tokens(drawn)
        return drawn
