"""One batch through the engine, timed: every prompt submitted at once, steps run to completion;
the throughput inside the window while all requests are in flight (bench/sweep.py's docstring says
why that window), end to end, and the K chosen per step. The sweep, mixed, trees and logprobs
benches run their batches here."""

from __future__ import annotations

import time
from collections import Counter

from engine.request import PHASES

PREFILL_BUDGET = 8192  # tokens a step may take: every batch's prompts in one step (4,744 at batch 64)


def run_batch(llm, prompts: list[str], params) -> dict:
    """Submits every prompt (`params`: one SamplingParams for all, or one per prompt), steps to
    completion; returns throughputs and the K chosen per step."""
    engine = llm.engine
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, per_prompt, strict=True)]
    ks: Counter[int] = Counter()  # decode steps by the K they used (0 = plain decode)
    window_ks: Counter[int] = Counter()  # ... of those, the steps inside the window
    started: set[str] = set()  # requests with their first token
    window_tokens, window_seconds, window_steps = 0, 0.0, 0
    window_phases = dict.fromkeys(PHASES, 0.0)  # where the window's step time went
    # "before" the last first token; "catch_up": the step after it, where a model proposer reads
    # the prompts; "open" while all are in flight; "closed" from the step that finishes a request
    window = "before"
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        t_step = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - t_step
        in_window = window == "open"
        if in_window:
            window_tokens += len(outputs)
            window_seconds += seconds
            window_steps += 1
            for phase, sec in engine.last_step.phases.items():
                window_phases[phase] += sec
        if any(o.finished for o in outputs):
            window = "closed"
        elif window == "catch_up":
            window = "open"
        elif window == "before":
            started.update(o.request_id for o in outputs)
            if len(started) == len(ids):
                window = "catch_up"
        stats = engine.last_step.decode
        if stats is not None:  # None: the step decoded nothing (prefill only)
            ks[stats.k] += 1
            if in_window:
                window_ks[stats.k] += 1
    dt = time.perf_counter() - t0
    outs = [engine.get_output(rid) for rid in ids]
    for rid in ids:
        engine.release(rid)
    drafted = sum(o.num_draft_tokens for o in outs)
    total = sum(len(o.token_ids) for o in outs)
    return {"tok_s": window_tokens / window_seconds if window_seconds else total / dt,
            "tok_s_end_to_end": total / dt, "window_steps": window_steps, "k_steps": dict(ks),
            "window_k_steps": dict(window_ks),
            "window_ms_per_token": {ph: sec * 1e3 / window_tokens for ph, sec in window_phases.items()}
            if window_tokens else None,
            "acceptance": sum(o.num_accepted_tokens for o in outs) / drafted if drafted else None,
            "tokens": [o.token_ids for o in outs]}
