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


def timed_generate(ctx: Context, llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                   ) -> dict:
    """Runs prompts to completion (`params`: for all, or one per prompt); wall time includes
    prefill (as transformers' generate does)."""
    engine = llm.engine
    each = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, each, strict=True)]
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


def busy_share(ctx: Context, llm: LLM, vocab: int, steps: int = 16) -> dict | None:
    """Kernel time of `steps` batch-1 decode steps over their unprofiled wall time, kernels a step,
    and the kernels that take the most time (CUDA only)."""
    if not ctx.device.startswith("cuda"):
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    rid = engine.add_request(random_prompts(1, 32, vocab, seed=99)[0],
                             SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    while not engine.request(rid).output_token_ids:
        engine.step()
    n = steps
    _, wall = ctx.timed(lambda: [engine.step() for _ in range(n)])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
        ctx.sync()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernel_us = sum(e.time_range.elapsed_us() for e in kernels)
    by_name: dict[str, list[float]] = {}  # kernel name -> [launches, microseconds] over the n steps
    for e in kernels:
        entry = by_name.setdefault(e.name[:120], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    engine.abort(rid)
    engine.release(rid)
    return {"kernel_ms_per_step": kernel_us / 1e3 / n, "wall_ms_per_step": 1e3 * wall / n,
            "busy_share": kernel_us / 1e6 / wall, "kernels_per_step": len(kernels) / n,
            "top_kernels": [{"name": name, "per_step": c / n, "us_per_step": us / n} for name, (c, us) in top]}
