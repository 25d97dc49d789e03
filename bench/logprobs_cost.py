"""What logprobs cost: output-token logprobs on vs off, plain decoding and speculation, batch 1 and 16.

    python -m bench logprobs [--batches 1 16] [--tokens 96] [--repeats 5] [--top 5]

The shipped pair (target and EAGLE-3 head); held-out code prompts decode greedily (ignore_eos: every variant emits --tokens tokens), with
no logprobs, with each token's logprob (`logprobs=0`) and with --top alternatives, each plain and
under the served default (EAGLE-3, adaptive K), interleaved. Figures: tok/s with logprobs ÷
without (goal >= 0.95) and speculation's speedup with logprobs ÷ without (goal >= 0.95).
"""

from __future__ import annotations

import statistics

import torch

from bench.batch_run import run_batch
from bench.common import PLAIN, adaptive, interleave, parser, summarize, write
from bench.workloads import load_prompts

SPECULATION = {"plain": PLAIN, "eagle adaptive": adaptive("eagle")}


def main(argv: list[str] | None = None) -> None:
    ap = parser("logprobs", __doc__, tokens=96, models=False)
    from serve_app.cli import forward_plan_arg

    ap.add_argument("--forward-plan", default="auto", type=forward_plan_arg)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--top", type=int, default=5, help="top alternatives in the richest variant")
    ap.set_defaults(repeats=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams

    pool = load_prompts("code") + load_prompts("edit")
    llm = LLM(forward_plan=args.forward_plan, speculative_method="eagle", max_batch_size=max(args.batches), max_seq_len=1024,
              enable_prefix_caching=False, max_num_batched_tokens=2048)
    kinds = {"off": None, "logprobs": 0, f"top {args.top}": args.top}
    results = {}
    for b in args.batches:
        prompts = pool[:b]

        def variant(spec, logprobs, prompts=prompts):
            params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=logprobs)

            def go():
                llm.engine.reconfigure_speculation(**spec)
                run = run_batch(llm, prompts, params)
                del run["tokens"]
                return run
            return go

        variants = {f"{kind} {name}": variant(spec, lp) for kind, lp in kinds.items()
                    for name, spec in SPECULATION.items()}
        for fn in variants.values():
            fn()  # warm-up: every shape once
        runs = interleave(variants, args.repeats, f"batch {b}")
        row = {name: {"tok_s": summarize(rs, "tok_s_end_to_end"),
                      "acceptance": statistics.median(r["acceptance"] or 0.0 for r in rs)} for name, rs in runs.items()}
        for kind in kinds:
            if kind == "off":
                continue
            ratios = {name: row[f"{kind} {name}"]["tok_s"]["median"] / row[f"off {name}"]["tok_s"]["median"]
                      for name in SPECULATION}
            speedup_on = row[f"{kind} eagle adaptive"]["tok_s"]["median"] / row[f"{kind} plain"]["tok_s"]["median"]
            speedup_off = row["off eagle adaptive"]["tok_s"]["median"] / row["off plain"]["tok_s"]["median"]
            row[f"{kind} cost"] = {"on_over_off": ratios, "speedup_on": speedup_on, "speedup_off": speedup_off,
                                   "speedup_kept": speedup_on / speedup_off}
            print(f"batch {b:2d} {kind}: tok/s on÷off plain {ratios['plain']:.3f}, speculative "
                  f"{ratios['eagle adaptive']:.3f}; speedup {speedup_on:.2f}x vs {speedup_off:.2f}x "
                  f"-> kept {speedup_on / speedup_off:.3f}")
        results[str(b)] = row
    path = write("logprobs_cost", {"tokens": args.tokens, "repeats": args.repeats, "results": results}, llm)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
