"""Start-up timing of the passes the adaptive policy prices: target passes of 1..K tokens a
sequence and a draft's first pass and one-token steps, at one batch size over a typical context,
recorded into MeasuredCosts (calibration.py decides when, and caches the result)."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator

from engine.kv import CachePool
from engine.model.passes import fill_slots, time_pass
from engine.model.transformer import Transformer
from engine.speculative.policy.costs import MeasuredCosts

CALIBRATION_CONTEXT = 128  # keys each calibration pass attends to: attention's share as in a typical context
CATCH_UP_TOKENS = (64, 256)  # a long catch-up's lengths timed at batch 1: its line's fixed part and per token


def calibrate_batch(costs: MeasuredCosts, target: tuple[Transformer, CachePool], draft: tuple[Transformer, CachePool] | None,
                    max_tokens: int, batch: int, repeats: int = 3) -> int:
    """Times, at `batch` sequences over CALIBRATION_CONTEXT keys each (fewer where the pools are
    smaller), target passes of 1..max_tokens tokens per sequence and draft passes (a round's first,
    catching up on 1, 2 and max_tokens tokens, and a one-token step, which prices a round's
    1..max_tokens - 1 further steps until they are measured); at batch 1 also the draft's long,
    prefill-like catch-ups (CATCH_UP_TOKENS), which the policy prices before its first step
    reads a prompt (unpriced, the first step paid one it had weighed as free). Each model's sequences are filled
    once; each shape runs once untimed first (one-off costs a policy must not mistake for the
    steady cost) and the median of `repeats` is recorded. Returns the passes run."""
    pools = [target[1]] + ([draft[1]] if draft is not None else [])
    context = max(1, min([CALIBRATION_CONTEXT] + [_room(pool, batch) - max_tokens for pool in pools]))
    passes = 0
    with _filled(*target, batch, context) as slots:
        for t in range(1, max_tokens + 1):
            costs.observe_target(batch, t, _median_pass(*target, slots, t, context, repeats, all_logits=t > 1))
            passes += repeats + 1
    if draft is not None:
        with _filled(*draft, batch, context) as slots:
            for width in sorted({1, 2, max_tokens}):
                costs.observe_draft_first(batch, width, _median_pass(*draft, slots, width, context, repeats))
            step = _median_pass(*draft, slots, 1, context, repeats)
            passes += 4 * (repeats + 1)
        for n in range(1, max_tokens):
            costs.observe_draft_steps(batch, n, n * step)
        if batch == 1:
            passes += _calibrate_catch_up(costs, *draft, repeats)
    return passes


def _calibrate_catch_up(costs: MeasuredCosts, model: Transformer, pool: CachePool, repeats: int) -> int:
    """Times one sequence's catch-up passes of CATCH_UP_TOKENS tokens (after one token of context;
    fewer where the pool is smaller) into the catch-up line; returns the passes run. An EAGLE-3
    head's passes here take no target features (its fc is left out), so the line starts a little
    low; every real catch-up refines it."""
    room = _room(pool, 1) - 1
    lengths = sorted({max(1, min(n, room)) for n in CATCH_UP_TOKENS})
    with _filled(model, pool, 1, 1) as slots:
        for n in lengths:
            costs.observe_catch_up(n, _median_pass(model, pool, slots, n, 1, repeats))
    return len(lengths) * (repeats + 1)


def _room(pool: CachePool, batch: int) -> int:
    """Tokens each of `batch` new sequences can hold in `pool`."""
    shared = pool.free_token_capacity()
    return pool.max_seq_len if shared is None else min(pool.max_seq_len, shared // batch)


@contextlib.contextmanager
def _filled(model: Transformer, pool: CachePool, batch: int, context: int) -> Iterator[list[int]]:
    """`batch` slots of `pool` holding `context` tokens each, freed after."""
    slots = fill_slots(model, pool, batch, context)
    try:
        yield slots
    finally:
        for s in slots:
            pool.free_slot(s)


def _median_pass(model: Transformer, pool: CachePool, slots: list[int], tokens: int, context: int, repeats: int,
                 all_logits: bool = False) -> float:
    time_pass(model, pool, slots, tokens, context, all_logits)  # warms up, untimed
    return statistics.median(time_pass(model, pool, slots, tokens, context, all_logits) for _ in range(repeats))
