"""Timed generation on an engine, shared by the speed sections: tokens per second over the whole
run, the median decode-only step, and the acceptance the run saw."""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import per_token_alpha
from bench.gpu.context import Context
from engine import LLM, SamplingParams


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def timed_generate(ctx: Context, llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Runs prompts to completion; wall time includes prefill (as transformers' generate does)."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    steps: list[float] = []  # decode-only steps
    phases = {"draft": 0.0, "target": 0.0, "other": 0.0}  # their seconds by phase
    ks: list[int] = []  # each decode-only step's K (0: plain)
    ctx.sync()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        last = engine.last_step
        if last.decode is not None and last.phases.prefill == 0:
            steps.append(time.perf_counter() - t)
            ks.append(last.decode.k)
            for phase in phases:
                phases[phase] += getattr(last.phases, phase)
    ctx.sync()
    seconds = time.perf_counter() - t0
    outs = [engine.get_output(r) for r in ids]
    for r in ids:
        engine.release(r)
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.num_draft_tokens for o in outs)
    rounds = sum(o.num_spec_rounds for o in outs)
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "step_ms": 1e3 * statistics.median(steps) if steps else None, "steps": len(steps),
            "acceptance": sum(o.num_accepted_tokens for o in outs) / drafted if drafted else None,  # ÷ drafted
            "alpha": per_token_alpha(outs),  # per token: what Thm 3.8 takes
            "mean_k": drafted / rounds if rounds else 0.0,  # proposals a round, over rounds that speculated
            "spec_rounds": rounds, "first_tokens": outs[0].token_ids[:16],
            "phase_ms_per_step": {p: 1e3 * v / len(steps) for p, v in phases.items()} if steps else None,
            "k_per_step": {k: ks.count(k) for k in sorted(set(ks))}, "outputs": [o.token_ids for o in outs]}


def median_of(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return {"median": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def transformers_generate(ctx: Context, hf, prompts: list[list[int]], new_tokens: int) -> dict:
    """transformers' generate, greedy, its default cache, on the same prompts."""
    ids = torch.tensor(prompts, device=ctx.device)
    with torch.inference_mode():
        ctx.sync()
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        ctx.sync()
        seconds = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "first_tokens": out[0, ids.shape[1]:ids.shape[1] + 16].tolist()}
