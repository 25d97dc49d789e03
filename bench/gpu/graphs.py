"""CUDA graphs on ÷ off (section `cuda_graphs`, through --sections) on the Llama-3.2-1B shape in
bf16: the same engine with the setting flipped, plain and speculative (the 2-layer prefix draft,
fixed K = 4), at batch 1, 8 and 32, side by side in one run; what the setting cost at load (capture or check time, device memory) and whether the
load-time self-check kept it (a fallback is a failed check)."""

from __future__ import annotations

import time

import torch

from bench.gpu.context import Context, check
from bench.gpu.decode import median_of, random_prompts, timed_generate
from bench.random_checkpoints import (
    LLAMA_3_2_1B,
    SMOKE_1B,
    hf_model,
    hf_tensors,
    target_and_prefix_draft,
    weights_in_memory,
)
from engine import LLM, SamplingParams

K = 4
DRAFT_LAYERS = 2
BATCHES = (1, 8, 32)


def run_graphs(ctx: Context, out: dict) -> None:
    """Graphs on ÷ off, 32-token prompts."""
    _compare(ctx, out, "cuda_graphs", "on", "off", prompt_len=32)


def _compare(ctx: Context, out: dict, setting: str, on: str, off: str, prompt_len: int) -> None:
    config = ctx.size(LLAMA_3_2_1B, SMOKE_1B)
    work = ctx.work / setting
    hf = hf_model(config, getattr(torch, ctx.dtype), ctx.device)
    target, draft, store = target_and_prefix_draft(work, config, hf_tensors(hf), DRAFT_LAYERS)
    del hf
    new = ctx.size(64, 6)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    max_seq_len = prompt_len + new + K + 8
    out.update(setting=setting, on=on, off=off, prompt_tokens=prompt_len, new_tokens=new, k=K, dtype=ctx.dtype)
    with weights_in_memory(store):
        for mode, spec in (("plain", {}), ("speculative", dict(use_speculative_decoding=True, speculative_method="draft",
                                                               draft_model=str(draft), spec_length=K,
                                                               spec_policy="fixed"))):
            engines = {}
            for value in (off, on):
                ctx.free()
                before = torch.cuda.memory_allocated() if ctx.device.startswith("cuda") else 0
                t0 = time.perf_counter()
                engines[value] = LLM(**ctx.engine_kwargs(max(BATCHES), max_seq_len, model=str(target), dtype=ctx.dtype,
                                                         **{setting: value}, **spec))
                load = out.setdefault("load", {}).setdefault(mode, {})[value] = _load_report(
                    ctx, engines[value], setting, time.perf_counter() - t0, before)
                ctx.log(f"{setting}={value}, {mode}: loaded in {load['seconds']:.1f} s {load.get(setting)}")
            kept = out["load"][mode][on].get(setting) or {}
            check(out, f"{mode}: {setting}={on} kept by its load-time check",
                  bool(kept) and all(_kept(v) for v in kept.values()), kept)
            rows = out.setdefault(mode, {})
            for batch in BATCHES:
                prompts = random_prompts(batch, prompt_len, config["vocab_size"], seed=batch)
                runs = {value: [] for value in engines}
                if not ctx.smoke:  # warm-up
                    for llm in engines.values():
                        timed_generate(ctx, llm, prompts, params)
                for _ in range(ctx.size(3, 1)):
                    for value, llm in engines.items():
                        runs[value].append(timed_generate(ctx, llm, prompts, params))
                r = rows[batch] = {value: {"tok_s": median_of(runs[value], "tok_s"),
                                           "step_ms": median_of(runs[value], "step_ms")} for value in engines}
                r["speedup"] = r[on]["tok_s"]["median"] / r[off]["tok_s"]["median"]
                r["same_tokens"] = runs[on][0]["first_tokens"] == runs[off][0]["first_tokens"]
                if mode == "speculative":
                    r["acceptance"] = median_of(runs[on], "acceptance")["median"]
                ctx.log(f"{mode} batch {batch}: {setting} {on} / {off} = {r['speedup']:.2f}x "
                        f"({r[on]['tok_s']['median']:.1f} vs {r[off]['tok_s']['median']:.1f} tok/s)")
                if ctx.dtype == "float32":  # exact arithmetic either way: the same greedy tokens
                    check(out, f"{mode} batch {batch}: the same greedy tokens with {setting} {on} and {off}",
                          r["same_tokens"])
            del engines
    out["summary"] = _summary(out)


def _load_report(ctx: Context, llm: LLM, setting: str, seconds: float, before: int) -> dict:
    """Load time, the device memory the engine took, and what the setting's load-time step reported."""
    engine = llm.engine
    report = {"seconds": seconds, "phases": dict(engine.startup)}
    if ctx.device.startswith("cuda"):
        report["device_gib"] = (torch.cuda.memory_allocated() - before) / 2**30
    if setting == "cuda_graphs":
        report[setting] = {role: {"graphs": r.graphs, "seconds": r.seconds, "gib": r.bytes / 2**30,
                                  "fallback": r.fallback} for role, r in engine.cuda_graphs.items()}
    else:
        report[setting] = dict(engine.paged_attention)
    return report


def _kept(value) -> bool:
    return value == "inplace" if isinstance(value, str) else value["fallback"] is None and value["graphs"] > 0


def _summary(out: dict) -> list[str]:
    setting, on, off = out["setting"], out["on"], out["off"]
    lines = []
    for mode in ("plain", "speculative"):
        load = out.get("load", {}).get(mode, {}).get(on)
        if load:
            lines.append(f"{mode}, {setting}={on} at load: {load['seconds']:.1f} s in all, {load.get(setting)}")
        for batch, r in out.get(mode, {}).items():
            lines.append(f"{mode} batch {batch} ({out['prompt_tokens']}-token prompts): {on} / {off} = {r['speedup']:.2f}x "
                         f"({r[on]['tok_s']['median']:.1f} vs {r[off]['tok_s']['median']:.1f} tok/s; step "
                         f"{r[on]['step_ms']['median'] or 0:.2f} vs {r[off]['step_ms']['median'] or 0:.2f} ms)"
                         + ("" if r["same_tokens"] else ", first tokens differ"))
    return lines
