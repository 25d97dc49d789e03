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


def calibrate_batch(costs: MeasuredCosts, target: tuple[Transformer, CachePool], draft: tuple[Transformer, CachePool] | None,
                    max_tokens: int, batch: int, repeats: int = 3) -> int:
    """Times, at `batch` sequences over CALIBRATION_CONTEXT keys each (fewer where the pools are
    smaller), target passes of 1..max_tokens tokens per sequence and draft passes (a round's first,
    catching up on 1, 2 and max_tokens tokens, and a one-token step, which prices a round's
    1..max_tokens - 1 further steps until they are measured). Each model's sequences are filled
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
    return passes


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
