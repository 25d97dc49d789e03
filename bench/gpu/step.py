"""A decode step against what the GPU can do (section `step`): the Llama-3.2-1B and Llama-3.1-8B
shapes in bf16, plain batch-1 decoding replayed from CUDA graphs, the engine with its layers'
pointwise work eager and in the fused kernels (`fused_kernels` off ÷ on): kernels a step, the
share of the step the GPU is busy, and the step ÷ the bound.

The bound, defined honestly: the bytes a step must read ÷ the measured copy bandwidth. The bytes:
every linear weight (q/k/v, o, gate/up, down of every layer, and the output layer), every norm
weight, the embedding rows the step reads (one), and the KV cache it attends over (layers x 2 x
kv_heads x head_dim x context). The bandwidth: the environment section's device-to-device copy,
bytes read and written per second, the rate the memory sustains."""

from __future__ import annotations

import torch

from bench.gpu.context import Context, check, goal
from bench.gpu.decode import busy_share, median_of, random_prompts, timed_generate
from bench.random_checkpoints import (
    LLAMA_3_1_8B,
    LLAMA_3_2_1B,
    SMOKE_1B,
    SMOKE_8B,
    RandomTensors,
    checkpoint_dir,
    weights_in_memory,
)
from engine import LLM, SamplingParams

PROMPT, NEW = 32, 64  # a step attends over about PROMPT + NEW / 2 keys
GOALS = {"1b": 0.45, "8b": 0.75}  # plain batch-1 step ÷ the bound


def step_bytes(config: dict, value_bytes: int, context: int) -> dict:
    """The bytes one batch-1 decode step reads, by part."""
    H, inter, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d, L = config.get("head_dim") or H // heads, config["num_hidden_layers"]
    per_layer = (heads + 2 * kv) * d * H + H * heads * d + 2 * inter * H + H * inter
    return {"linear": (L * per_layer + V * H) * value_bytes, "norms": (2 * L + 1) * H * value_bytes,
            "embedding_rows": H * value_bytes, "kv": L * 2 * kv * d * context * value_bytes}


def run(ctx: Context, out: dict) -> None:
    bandwidth = ctx.report.get("sections", {}).get("environment", {}).get("copy_tb_s")
    for name, config in (("1b", ctx.size(LLAMA_3_2_1B, SMOKE_1B)), ("8b", ctx.size(LLAMA_3_1_8B, SMOKE_8B))):
        out[name] = _shape(ctx, out, name, config, bandwidth)
        ctx.free()
    out["summary"] = [f"{name}: " + ", ".join(
        f"{mode} step {r['step_ms']:.2f} ms ({r.get('kernels_per_step') or '?'} kernels, busy "
        f"{100 * (r.get('busy_share') or 0):.0f}%, {100 * (r.get('of_bound') or 0):.0f}% of the bound)"
        for mode, r in out[name]["modes"].items()) + (f"; bound {out[name]['bound_ms']:.2f} ms" if out[name].get("bound_ms") else "")
        for name in ("1b", "8b")]


def _shape(ctx: Context, out: dict, name: str, config: dict, bandwidth: float | None) -> dict:
    target = checkpoint_dir(ctx.work / f"step_{name}", config)
    store = {str(target): RandomTensors(config, getattr(torch, ctx.dtype), ctx.device)}
    params = SamplingParams(temperature=0, max_tokens=ctx.size(NEW, 8), ignore_eos=True)
    prompts = random_prompts(1, PROMPT, config["vocab_size"], seed=3)
    value_bytes = torch.finfo(getattr(torch, ctx.dtype)).bits // 8
    read = step_bytes(config, value_bytes, PROMPT + params.max_tokens // 2)
    row = {"bytes_read": read, "modes": {}}
    if bandwidth:
        row["bound_ms"] = sum(read.values()) / 1e9 / bandwidth  # GB / (TB/s) = ms
    outputs = {}
    for mode in ("off", "on"):
        with weights_in_memory(store):
            llm = LLM(**ctx.engine_kwargs(1, 512, model=str(target), dtype=ctx.dtype, fused_kernels=mode))
        runs = [timed_generate(ctx, llm, prompts, params) for _ in range(ctx.size(4, 1))]
        r = row["modes"][f"fused {mode}"] = {"step_ms": median_of(runs[ctx.size(1, 0):], "step_ms")["median"],
                                             "fused_kernels": dict(llm.engine.fused_kernels)}
        outputs[mode] = runs[-1]["outputs"]
        busy = busy_share(ctx, llm, config["vocab_size"])
        if busy is not None:
            r.update(busy_share=busy["busy_share"], kernels_per_step=round(busy["kernels_per_step"]),
                     top_kernels=busy["top_kernels"][:12])
        if row.get("bound_ms"):
            r["of_bound"] = row["bound_ms"] / r["step_ms"]
        ctx.log(f"{name} fused {mode}: step {r['step_ms']:.2f} ms, {r.get('kernels_per_step')} kernels, "
                f"{llm.engine.fused_kernels}")
        del llm
        ctx.free()
    check(out, f"{name}: the fused kernels were kept by their load-time check", row["modes"]["fused on"]["fused_kernels"].get(
        "target") == "fused" or not ctx.device.startswith("cuda"), row["modes"]["fused on"]["fused_kernels"])
    if ctx.dtype == "float32":
        check(out, f"{name}: the same greedy tokens eager and fused", outputs["on"] == outputs["off"])
    of_bound = row["modes"]["fused on"].get("of_bound")
    goal(out, f"{name} plain batch-1 step >= {GOALS[name]:.0%} of the bound", (of_bound or 0) >= GOALS[name], of_bound)
    return row
