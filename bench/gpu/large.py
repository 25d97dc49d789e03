"""A Llama-3.1-8B shape in bf16 with random weights made on the device (16 GB, never written to disk):
plain batch-1 decode against the bound of reading every weight once a step at the measured copy
bandwidth, and speculation with a prefix draft of its first layers (fixed K) at batch 1."""

from __future__ import annotations

import torch

from bench.common import theoretical
from bench.gpu.check import Context
from bench.gpu.decode import median_of, random_prompts, timed_generate
from bench.gpu.weights import LLAMA_3_1_8B, SMOKE_8B, RandomTensors, target_and_prefix_draft, weights_in_memory
from engine import LLM, SamplingParams

K = 4
DRAFT_LAYERS = 2


def run(ctx: Context, out: dict) -> None:
    config = ctx.size(LLAMA_3_1_8B, SMOKE_8B)
    dtype = ctx.dtype
    work = ctx.work / "llama_8b"
    tensors = RandomTensors(config, getattr(torch, dtype), ctx.device)
    target, draft, store = target_and_prefix_draft(work, config, tensors, DRAFT_LAYERS)
    new = ctx.size(64, 8)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    prompts = random_prompts(1, 32, config["vocab_size"], seed=1)
    with weights_in_memory(store):
        plain = LLM(**ctx.engine_kwargs(1, 512, model=str(target), dtype=dtype))
        weights_gb = plain.engine.model.num_parameters * plain.engine.model.dtype.itemsize / 1e9
        ctx.log(f"8B shape loaded: {weights_gb:.1f} GB of weights")
        timed_generate(ctx, plain, prompts, params)
        runs = [timed_generate(ctx, plain, prompts, params) for _ in range(ctx.size(3, 1))]
        out["plain_batch1"] = {"tok_s": median_of(runs, "tok_s"), "step_ms": median_of(runs, "step_ms")}
        step_ms = out["plain_batch1"]["step_ms"]["median"]
        bandwidth = ctx.report.get("sections", {}).get("environment", {}).get("copy_tb_s")
        if bandwidth:
            bound_ms = weights_gb / bandwidth  # GB / (TB/s) = ms
            out["batch1_bound"] = {"weights_gb": weights_gb, "copy_tb_s": bandwidth, "bound_ms": bound_ms,
                                   "step_ms": step_ms, "share_of_bound": bound_ms / step_ms}
            ctx.log(f"8B plain batch 1: step {step_ms:.2f} ms, bound {bound_ms:.2f} ms ({100 * bound_ms / step_ms:.0f}%)")
        if ctx.left() < ctx.size(30, 5):
            out["speculative"] = "skipped: out of budget"
        else:
            draft_alone = LLM(**ctx.engine_kwargs(1, 512, model=str(draft), dtype=dtype))
            spec = LLM(**ctx.engine_kwargs(1, 512, model=str(target), dtype=dtype, use_speculative_decoding=True,
                                           speculative_method="draft", draft_model=str(draft), spec_length=K,
                                           spec_policy="fixed"))
            timed_generate(ctx, spec, prompts, params)
            s = timed_generate(ctx, spec, prompts, params)
            d = timed_generate(ctx, draft_alone, prompts, params)
            c = d["step_ms"] / step_ms
            bound = theoretical(s["acceptance"], K, c)
            speedup = s["tok_s"] / out["plain_batch1"]["tok_s"]["median"]
            out["speculative"] = {"k": K, "draft_layers": DRAFT_LAYERS, "tok_s": s["tok_s"], "speedup": speedup,
                                  "alpha": s["acceptance"], "c": c, "thm_3_8_bound": bound,
                                  "measured_over_bound": speedup / bound}
            ctx.log(f"8B speculative K={K}: {speedup:.2f}x (alpha {s['acceptance']:.3f}, c {c:.3f}, bound {bound:.2f}x)")
            del draft_alone, spec
        del plain
    out["summary"] = [f"8B plain batch 1: {out['plain_batch1']['tok_s']['median']:.1f} tok/s, step {step_ms:.2f} ms"
                      + (f", weights / bandwidth bound {out['batch1_bound']['bound_ms']:.2f} ms "
                         f"({100 * out['batch1_bound']['share_of_bound']:.0f}% of bound)" if "batch1_bound" in out else "")]
    if isinstance(out.get("speculative"), dict):
        s = out["speculative"]
        out["summary"].append(f"8B speculative K={K} ({DRAFT_LAYERS}-layer prefix draft): {s['speedup']:.2f}x, "
                              f"alpha {s['alpha']:.3f}, c {s['c']:.3f}, measured / Thm 3.8 bound {s['measured_over_bound']:.2f}")
