"""A K per request on the GPU (section `per_request`; `python -m bench mixed` on CPU): the
realistic-acceptance pair at Llama-3.2-1B's shape (bench/gpu/realistic.py), a batch of which half
decode greedily (the pair agrees at ALPHA) and half sample at T = 1 (it agrees less), one engine
reconfigured between plain decoding, one K a step and a K per request, interleaved, at batch 8 and
32. Passes replayed from CUDA graphs stay padded, so there a K per request saves drafting and
the rows' share of the verify pass only where graphs are off or do not fit.
"""

from __future__ import annotations

from bench.gpu.context import Context, check, goal
from bench.gpu.decode import median_of, random_prompts, timed_generate
from bench.gpu.realistic import build_pair
from bench.random_checkpoints import LLAMA_3_2_1B, SMOKE_1B, weights_in_memory
from engine import LLM, SamplingParams

GOAL = 1.15  # per-request ÷ one K on the mix
VARIANTS = {"plain": {"use_speculative_decoding": False},
            "one K": {"use_speculative_decoding": True, "spec_policy": "adaptive", "k_per_request": False},
            "per-request K": {"use_speculative_decoding": True, "spec_policy": "adaptive", "k_per_request": True}}


def mixed_params(batch: int, new_tokens: int) -> list[SamplingParams]:
    """Greedy and T = 1 alternating (seeded: the same text for every variant)."""
    return [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i, max_tokens=new_tokens, ignore_eos=True)
            for i in range(batch)]


def run(ctx: Context, out: dict) -> None:
    config = ctx.size(LLAMA_3_2_1B, SMOKE_1B)
    new = ctx.size(96, 12)
    batches = ctx.size((8, 32), (4,))
    target, draft, store, out["pair"] = build_pair(ctx, config, 1, new, "per_request")
    with weights_in_memory(store):
        llm = LLM(**ctx.engine_kwargs(max(batches), 512, model=str(target), dtype=ctx.dtype,
                                      use_speculative_decoding=True, speculative_method="draft",
                                      draft_model=str(draft), spec_length=8))
    store.clear()
    ctx.free()
    rows = out["batches"] = {}
    for batch in batches:
        prompts, params = random_prompts(batch, 32, config["vocab_size"], seed=batch), mixed_params(batch, new)
        runs = {name: [] for name in VARIANTS}
        for r in range(ctx.size(3, 1)):  # interleaved, the order reversed every other repeat
            for name in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
                llm.engine.reconfigure_speculation(**VARIANTS[name])
                runs[name].append(timed_generate(ctx, llm, prompts, params))
        tok_s = {name: median_of(rs, "tok_s") for name, rs in runs.items()}
        rows[batch] = row = {"tok_s": tok_s, "over_plain": {n: v["median"] / tok_s["plain"]["median"]
                                                            for n, v in tok_s.items()},
                             "per_request_over_one_k": tok_s["per-request K"]["median"] / tok_s["one K"]["median"],
                             "same_greedy_tokens": _greedy_rows(runs["per-request K"]) == _greedy_rows(runs["plain"])}
        ctx.log(f"per-request batch {batch}: " + ", ".join(f"{n} {v:.2f}x" for n, v in row["over_plain"].items())
                + f" plain; per-request ÷ one K {row['per_request_over_one_k']:.3f}")
    for batch, row in rows.items():
        if ctx.dtype == "float32":
            check(out, f"batch {batch}: greedy rows equal plain with a K per request", row["same_greedy_tokens"])
        goal(out, f"batch {batch}: per-request K >= {GOAL} x one K", row["per_request_over_one_k"] >= GOAL,
             round(row["per_request_over_one_k"], 3))
    out["summary"] = [f"batch {b}: " + ", ".join(f"{n} {v:.2f}x" for n, v in r["over_plain"].items())
                      + f" plain; per-request ÷ one K {r['per_request_over_one_k']:.3f}" for b, r in rows.items()]


def _greedy_rows(runs: list[dict]) -> list:
    return [out for i, out in enumerate(runs[0]["outputs"]) if i % 2 == 0]
