"""Int8 vs float32 draft weights, side by side (the engine's `draft_quantization`).

    python -m bench draftq [--workload code] [--prompts 8] [--tokens 96] [--repeats 5]

Batch 1, greedy, the shipped pair, prefix caching off. Two engines on the same checkpoints
differ only in `draft_quantization` ("int8": the draft's narrow passes on int8 weight copies;
"none": float weights). Each runs fixed K = 3, fixed K = 5 and the adaptive policy, all
interleaved with plain decoding, repeated. The int8 / float32 speed of each speculative
setting is reported as the median of the per-repeat ratios (each ratio taken from runs a few
seconds apart), with its range, next to the time spent drafting per generated token (the
engine's phase split, steadier than tokens/s on a noisy host); the acceptance rate shows what
int8 costs. Every variant must produce plain decoding's tokens.

Int8 applies to the draft's torch passes over a few rows. With the draft token step on (the
default, `cpu_draft_token_step`), batch-1 steps skip those passes (the step reads full-precision
weights: int8 measured no faster there), so int8 only reaches steps over 4-8 sequences. To
measure what int8 does to those passes at batch 1, both engines here run with the token step
off.
"""

from __future__ import annotations

import statistics

import torch

from bench.common import (
    PLAIN,
    adaptive,
    add_batch1_options,
    batch1_llm,
    fixed,
    interleave,
    ours_variant,
    parser,
    summarize,
    write,
)
from bench.workloads import load_prompts
from engine.metrics import PHASES

SETTINGS = {
    "K=3": fixed("draft", 3),
    "K=5": fixed("draft", 5),
    "adaptive": adaptive("draft"),
}
WEIGHTS = ("none", "int8")  # draft_quantization values


def main(argv: list[str] | None = None) -> None:
    ap = parser("draftq", __doc__, tokens=96)
    add_batch1_options(ap, repeats=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import SamplingParams

    llms = {q: batch1_llm(args.target, args.draft, args.draft_vocab_size, q, draft_token_step=False) for q in WEIGHTS}
    prompts = [llms["none"].engine.tokenizer.encode(p) for p in load_prompts(args.workload, args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    variants = {"plain": ours_variant(llms["none"], PLAIN, prompts, params)}
    for setting, spec in SETTINGS.items():
        for q in WEIGHTS:
            variants[f"{setting} {q}"] = ours_variant(llms[q], spec, prompts, params)
    for fn in variants.values():  # warm-up: kernels, the adaptive policy's first measurements
        fn()
    runs = interleave(variants, args.repeats, f"draft weights ({args.workload})")
    plain_tokens = runs["plain"][0]["tokens"]
    table = {}
    for name, rs in runs.items():
        if any(r["tokens"] != plain_tokens for r in rs):
            raise SystemExit(f"{name}: greedy tokens differ from plain decoding")
        drafted = [r for r in rs if r["acceptance"] is not None]
        table[name] = {"tok_s": summarize(rs, "tok_s"),
                       "acceptance": statistics.median(r["acceptance"] for r in drafted) if drafted else None,
                       "ms_per_token": {k: statistics.median(r["ms_per_token"][k] for r in rs) for k in PHASES}}
    ratios = {}
    for setting in SETTINGS:
        per_repeat = [a["tok_s"] / b["tok_s"] for a, b in zip(runs[f"{setting} int8"], runs[f"{setting} none"])]
        ratios[setting] = {"median": statistics.median(per_repeat), "min": min(per_repeat),
                           "max": max(per_repeat), "n": len(per_repeat)}
        print(f"{setting:9s} int8 / float32 draft: {ratios[setting]['median']:.3f}x "
              f"(per repeat {min(per_repeat):.2f}-{max(per_repeat):.2f}); acceptance "
              f"{table[f'{setting} none']['acceptance']:.3f} -> {table[f'{setting} int8']['acceptance']:.3f}; "
              f"drafting {table[f'{setting} none']['ms_per_token']['draft']:.2f} -> "
              f"{table[f'{setting} int8']['ms_per_token']['draft']:.2f} ms per token")
    path = write("draft_weights", {"workload": args.workload, "prompts": len(prompts), "tokens": args.tokens,
                                   "repeats": args.repeats, "batch": 1, "temperature": 0.0,
                                   "draft_token_step": False, "results": table, "int8_over_float": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
