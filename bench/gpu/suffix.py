"""Suffix decoding and prompt lookup ÷ plain decoding at batch 16 on a repetitive agent-like workload
(section `suffix`): agent turns (a code or edit prompt, the tool set, "next tool calls (JSON)"),
greedy, on the shipped target where the copy carries its weights (a random model's greedy text
collapses into one repeated token, which any lookup predicts: no measure of a workload), else on
the random Llama-3.2-1B shape with that caveat in the JSON. The suffix cache is warmed with the
answers to one set of requests; each variant then answers another set, all submitted at once, from
a copy of the same warm cache."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from bench.common import PLAIN, adaptive
from bench.gpu.context import Context, check, goal
from bench.gpu.decode import median_of, random_prompts
from bench.random_checkpoints import LLAMA_3_2_1B, SMOKE_1B, checkpoint_dir, hf_model, hf_tensors, weights_in_memory
from bench.workloads import agent_prompts
from engine import LLM, SamplingParams

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "target"
BATCH = 16
K_MAX = 16
VARIANTS = {"plain": PLAIN, "ngram": adaptive("ngram", K_MAX), "suffix": {**adaptive("suffix", K_MAX), "tree_width": 1}}


def _engine(ctx: Context, out: dict) -> tuple[LLM, list, list]:
    """The engine and the warm-up and measured prompts: the shipped target's agent turns, or
    random prompts on the random 1B shape."""
    kwargs = ctx.engine_kwargs(BATCH, 1024, dtype=ctx.dtype, speculative_method="suffix", spec_length=K_MAX)
    if (SHIPPED / "model.safetensors").exists():
        out["model"] = "shipped target (models/target)"
        prompts = agent_prompts()
        return LLM(model=str(SHIPPED), **kwargs), prompts[:ctx.size(32, 4)], prompts[32:32 + ctx.size(BATCH, 4)]
    config = ctx.size(LLAMA_3_2_1B, SMOKE_1B)
    out["model"] = "random Llama-3.2-1B shape: its greedy text repeats one token, a lookup's best case"
    target = checkpoint_dir(ctx.work / "suffix", config)
    with weights_in_memory({str(target): hf_tensors(hf_model(config, getattr(torch, ctx.dtype), ctx.device))}):
        llm = LLM(model=str(target), **kwargs)
    prompts = random_prompts(ctx.size(32, 4) + BATCH, 48, config["vocab_size"], seed=7)
    return llm, prompts[:ctx.size(32, 4)], prompts[ctx.size(32, 4):]


def run(ctx: Context, out: dict) -> None:
    llm, warm_prompts, prompts = _engine(ctx, out)
    params = SamplingParams(temperature=0, max_tokens=ctx.size(128, 12))
    speculation = llm.engine.speculation
    llm.engine.reconfigure_speculation(**VARIANTS["suffix"])
    llm.generate(warm_prompts, params)  # the cache learns these answers
    warm = copy.deepcopy(speculation.suffix_cache)
    out.update(batch=len(prompts), warm_requests=len(warm_prompts), new_tokens=params.max_tokens)

    def once(spec: dict) -> dict:
        speculation.suffix_cache = copy.deepcopy(warm)
        llm.engine.reconfigure_speculation(**spec)
        ctx.sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        ctx.sync()
        seconds = time.perf_counter() - t0
        rounds = sum(o.num_spec_rounds for o in outs)
        return {"tok_s": sum(len(o.token_ids) for o in outs) / seconds, "tokens": [o.token_ids for o in outs],
                "accepted_per_round": sum(o.num_accepted_tokens for o in outs) / rounds if rounds else 0.0}

    for spec in VARIANTS.values():  # warm-up: the policy's costs at this batch
        once(spec)
    runs = {name: [] for name in VARIANTS}
    for _ in range(ctx.size(3, 1)):
        for name, spec in VARIANTS.items():
            runs[name].append(once(spec))
    plain = median_of(runs["plain"], "tok_s")["median"]
    rows = out["variants"] = {name: {"tok_s": median_of(r, "tok_s"), "accepted_per_round": median_of(r, "accepted_per_round"),
                                     "over_plain": median_of(r, "tok_s")["median"] / plain} for name, r in runs.items()}
    if ctx.dtype == "float32":
        check(out, "greedy lookups give plain decoding's tokens", all(
            r["tokens"] == runs["plain"][0]["tokens"] for name in ("ngram", "suffix") for r in runs[name]))
    goal(out, f"suffix ÷ plain >= 2.5 at batch {BATCH}", rows["suffix"]["over_plain"] >= 2.5, rows["suffix"]["over_plain"])
    out["summary"] = [f"{out['model']}; batch {len(prompts)}, {params.max_tokens} tokens, cache warmed on "
                      f"{len(warm_prompts)} requests"]
    out["summary"] += [f"{name}: {r['tok_s']['median']:.1f} tok/s, {r['over_plain']:.2f}x plain, "
                       f"{r['accepted_per_round']['median']:.2f} accepted a round" for name, r in rows.items()]
