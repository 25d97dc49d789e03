"""Attention reading the paged pool in place ÷ over a gathered copy (section `paged_attention`), where
the gather's traffic counts: plain decoding at batch 1 and 32 over 2,048-token contexts on the
Llama-3.2-1B shape in bf16, both replayed from CUDA graphs as the engine serves, with 16- and
64-token blocks. Whether the load-time check kept in place (and captured it) is recorded with
its reason; `paged_attention: auto` stays the gather unless in place wins by the goal here."""

from __future__ import annotations

import torch

from bench.gpu.context import Context, check, goal
from bench.gpu.decode import median_of, random_prompts, timed_generate
from bench.random_checkpoints import LLAMA_3_2_1B, SMOKE_1B, checkpoint_dir, hf_model, hf_tensors, weights_in_memory
from engine import LLM, SamplingParams

GOAL = 1.3  # in place ÷ gather at batch 32 that would make in place the default


def run(ctx: Context, out: dict) -> None:
    config = ctx.size(LLAMA_3_2_1B, SMOKE_1B)
    prompt_len, new = ctx.size(2048, 48), ctx.size(64, 6)
    batches = ctx.size((1, 32), (1, 4))
    target = checkpoint_dir(ctx.work / "inplace", config)
    store = {str(target): hf_tensors(hf_model(config, getattr(torch, ctx.dtype), ctx.device))}
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    out.update(prompt_tokens=prompt_len, new_tokens=new, dtype=ctx.dtype)
    for block in (16, 64):
        with weights_in_memory(store):
            engines = {mode: LLM(**ctx.engine_kwargs(max(batches), prompt_len + new + 8, model=str(target),
                                                     dtype=ctx.dtype, block_size=block, paged_attention=mode))
                       for mode in ("gather", "inplace")}
        kept = engines["inplace"].engine.paged_attention
        graphs = {mode: {role: (r.graphs, r.fallback) for role, r in llm.engine.cuda_graphs.items()}
                  for mode, llm in engines.items()}
        rows = out.setdefault(f"block_{block}", {"load": {"paged_attention": kept, "cuda_graphs": graphs}})
        check(out, f"block {block}: the in-place engine's graphs were captured (or graphs are off here)",
              all(fallback is None for _, fallback in graphs["inplace"].values()), graphs["inplace"])
        for batch in batches:
            prompts = random_prompts(batch, prompt_len, config["vocab_size"], seed=batch)
            runs = {mode: [] for mode in engines}
            for _ in range(ctx.size(3, 1) + (0 if ctx.smoke else 1)):
                for mode, llm in engines.items():
                    runs[mode].append(timed_generate(ctx, llm, prompts, params))
            runs = {mode: r[0 if ctx.smoke else 1:] for mode, r in runs.items()}
            r = rows[batch] = {mode: {"tok_s": median_of(runs[mode], "tok_s"), "step_ms": median_of(runs[mode], "step_ms")}
                               for mode in engines}
            r["inplace_over_gather"] = r["inplace"]["tok_s"]["median"] / r["gather"]["tok_s"]["median"]
            if ctx.dtype == "float32":
                check(out, f"block {block} batch {batch}: the same greedy tokens in place and gathered",
                      runs["inplace"][0]["outputs"] == runs["gather"][0]["outputs"])
            ctx.log(f"block {block} batch {batch}: in place / gather {r['inplace_over_gather']:.2f}x "
                    f"(step {r['inplace']['step_ms']['median'] or 0:.2f} vs {r['gather']['step_ms']['median'] or 0:.2f} ms); "
                    f"in place kept: {kept}")
        del engines
        ctx.free()
    best = max(out[f"block_{b}"][max(batches)]["inplace_over_gather"] for b in (16, 64))
    goal(out, f"in place ÷ gather >= {GOAL} at batch {max(batches)} ({prompt_len}-token contexts, graphs)", best >= GOAL, best)
    out["auto"] = "inplace would pay: make it auto's choice" if best >= GOAL else \
        f"auto stays the gather: in place reached {best:.2f}x of it at batch {max(batches)} (goal {GOAL})"
    out["summary"] = [f"block {b} batch {batch}: in place / gather {out[f'block_{b}'][batch]['inplace_over_gather']:.2f}x; "
                      f"kept at load: {out[f'block_{b}']['load']['paged_attention']}"
                      for b in (16, 64) for batch in batches] + [out["auto"]]
