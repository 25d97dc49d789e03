"""A mixture of experts served (section `moe`, and `python -m bench moe` on CPU): Qwen3-30B-A3B's
layer shape (128 experts, top 8) at random weights, made a realistic-acceptance pair with its
prefix draft (bench/gpu/pair.py), one engine reconfigured between plain decoding, fixed K and
the adaptive policy, interleaved, at several batch sizes:
- plain, fixed K and adaptive tokens per second, each ÷ plain, and adaptive ÷ the best fixed K
  (the policy prices a verify pass from its measured cost, which on a MoE grows with the experts
  K + 1 tokens a row touch; goal >= 0.97);
- where the machine can hold a second copy, transformers' `generate` on the same weights.
The GPU run keeps 12 of the 48 layers, so the transformers model the pair is built on and the
engine's copy fit one card beside the KV pools.
"""

from __future__ import annotations

import torch

from bench.gpu.context import Context, check, goal
from bench.gpu.decode import median_of, random_prompts, timed_generate, transformers_generate
from bench.gpu.pair import PrefixPair, calibrate
from bench.gpu.quantized import engine_paths
from bench.random_checkpoints import (
    QWEN3_30B_A3B,
    SMOKE_MOE,
    hf_model,
    hf_tensors,
    target_and_prefix_draft,
    weights_in_memory,
)
from engine import LLM, SamplingParams

ALPHA = 0.8  # the pair's greedy per-token acceptance
FIXED_K = (2, 4)
GOAL = 0.97  # adaptive ÷ the best fixed K
GPU_MOE = {**QWEN3_30B_A3B, "num_hidden_layers": 12}


def measure(ctx: Context, config: dict, keep: int, batches: tuple[int, ...], new_tokens: int, repeats: int,
            with_transformers: bool) -> dict:
    """The pair, then each batch size: plain, fixed K and adaptive interleaved `repeats` times."""
    hf = hf_model(config, getattr(torch, ctx.dtype), ctx.device)
    pair = PrefixPair(hf, keep)
    prompts = torch.tensor(random_prompts(ctx.size(8, 4), 32, config["vocab_size"], seed=100), device=ctx.device)
    out = {"pair": calibrate(pair, prompts, ALPHA, new_tokens=min(new_tokens, 32), steps=ctx.size(8, 4), log=ctx.log)}
    target, draft, store = target_and_prefix_draft(ctx.work / "moe", config, hf_tensors(hf), keep)
    with weights_in_memory(store):
        llm = LLM(**ctx.engine_kwargs(max(batches), 32 + new_tokens + 16, model=str(target), dtype=ctx.dtype,
                                      use_speculative_decoding=True, speculative_method="draft",
                                      draft_model=str(draft), spec_length=8))
    out["paths"] = engine_paths(llm)  # graphs kept, the fused path, the experts' kernel path
    ctx.log(f"moe engine: {out['paths']}")
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    variants = {"plain": {"use_speculative_decoding": False},
                **{f"fixed K={k}": {"use_speculative_decoding": True, "spec_policy": "fixed", "spec_length": k,
                                    "k_per_request": False}
                   for k in FIXED_K},
                "adaptive": {"use_speculative_decoding": True, "spec_policy": "adaptive", "spec_length": 8,
                             "k_per_request": False},
                "per-request K": {"use_speculative_decoding": True, "spec_policy": "adaptive", "spec_length": 8,
                                  "k_per_request": True}}
    out["batches"] = {}
    for batch in batches:
        batch_prompts = random_prompts(batch, 32, config["vocab_size"], seed=batch)
        runs = {name: [] for name in variants}
        for r in range(repeats):  # interleaved, the order reversed every other repeat
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                llm.engine.reconfigure_speculation(**variants[name])
                runs[name].append(timed_generate(ctx, llm, batch_prompts, params))
        out["batches"][batch] = row = _row(runs)
        if with_transformers:
            row["transformers_tok_s"] = median_of([transformers_generate(ctx, hf, batch_prompts, new_tokens)
                                                   for _ in range(repeats)], "tok_s")
        ctx.log(f"moe batch {batch}: " + ", ".join(f"{n} {v['tok_s']['median']:.1f} tok/s" for n, v in row["variants"].items()))
    return out


def _row(runs: dict[str, list[dict]]) -> dict:
    variants = {name: {"tok_s": median_of(rs, "tok_s"), "alpha": median_of(rs, "alpha"),
                       "k_per_step": rs[-1]["k_per_step"]} for name, rs in runs.items()}
    plain = variants["plain"]["tok_s"]["median"]
    best = max((f"fixed K={k}" for k in FIXED_K), key=lambda n: variants[n]["tok_s"]["median"])
    return {"variants": variants, "over_plain": {n: v["tok_s"]["median"] / plain for n, v in variants.items()},
            "best_fixed": best, "adaptive_over_best_fixed": variants["adaptive"]["tok_s"]["median"]
            / variants[best]["tok_s"]["median"],
            "per_request_over_adaptive": variants["per-request K"]["tok_s"]["median"]
            / variants["adaptive"]["tok_s"]["median"],
            "same_tokens": all(r["outputs"] == runs["plain"][0]["outputs"] for rs in runs.values() for r in rs)}


def run(ctx: Context, out: dict) -> None:
    config = ctx.size(GPU_MOE, SMOKE_MOE)
    out["shape"] = "Qwen3-30B-A3B layers, 12 of 48" if not ctx.smoke else "smoke"
    out.update(measure(ctx, config, keep=1, batches=ctx.size((1, 8, 32), (1, 4)), new_tokens=ctx.size(64, 8),
                       repeats=ctx.size(3, 1), with_transformers=False))
    for batch, row in out["batches"].items():
        if ctx.dtype == "float32":
            check(out, f"batch {batch}: speculative output equals plain", row["same_tokens"])
        goal(out, f"batch {batch}: adaptive >= {GOAL} x the best fixed K", row["adaptive_over_best_fixed"] >= GOAL,
             round(row["adaptive_over_best_fixed"], 3))
    out["summary"] = [f"batch {b}: " + ", ".join(f"{n} {v:.2f}x" for n, v in r["over_plain"].items())
                      + f" plain; adaptive ÷ best fixed ({r['best_fixed']}) {r['adaptive_over_best_fixed']:.2f}"
                      for b, r in out["batches"].items()]
