"""The hand-written CPU kernels vs oneDNN/torch at batch 1, side by side: the one-sequence
kernel for the target's passes (`cpu_one_sequence_kernels`) and the draft's token step
(`cpu_draft_token_step`).

    python -m bench kernel [--workload code] [--prompts 8] [--tokens 96] [--repeats 3]

Batch 1, greedy, the shipped pair, prefix caching off. Three engines on the same checkpoints:
neither kernel, the target's kernel only, both. Each runs plain decoding, draft K = 5 and the
adaptive draft, n-gram and hybrid settings, all interleaved, repeated. Every ratio is the median
of per-repeat ratios against the same repeat's plain decoding on oneDNN, so the table reads both
what the kernel does to plain decoding and what speculation adds on top of each. Every variant
must produce the same tokens as plain decoding on oneDNN.
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
    "plain": PLAIN,
    "draft K=5": fixed("draft", 5),
    "draft adaptive": adaptive("draft"),
    "ngram adaptive": adaptive("ngram"),
    "hybrid adaptive": adaptive("hybrid"),
}
# label -> (cpu_one_sequence_kernels, cpu_draft_token_step)
KERNELS = {"oneDNN": (False, False), "one-sequence kernel": (True, False),
           "one-sequence kernel + draft token step": (True, True)}


def main(argv: list[str] | None = None) -> None:
    ap = parser("kernel", __doc__, tokens=96)
    add_batch1_options(ap, repeats=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import SamplingParams

    llms = {label: batch1_llm(args.target, args.draft, args.draft_vocab_size, args.draft_quantization, *on)
            for label, on in KERNELS.items()}
    prompts = [llms["oneDNN"].engine.tokenizer.encode(p) for p in load_prompts(args.workload, args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    variants = {f"{setting}, {label}": ours_variant(llm, spec, prompts, params)
                for setting, spec in SETTINGS.items() for label, llm in llms.items()}
    for fn in variants.values():  # warm-up: kernels, the adaptive policy's first measurements
        fn()
    runs = interleave(variants, args.repeats, f"one-sequence kernel ({args.workload})")
    base = runs["plain, oneDNN"]
    table = {}
    for name, rs in runs.items():
        if any(r["tokens"] != base[0]["tokens"] for r in rs):
            raise SystemExit(f"{name}: greedy tokens differ from plain decoding on oneDNN")
        per_repeat = [r["tok_s"] / b["tok_s"] for r, b in zip(rs, base)]
        own_plain = runs[f"plain, {name.split(', ')[1]}"]
        table[name] = {"tok_s": summarize(rs, "tok_s"),
                       "vs_onednn_plain": {"median": statistics.median(per_repeat), "min": min(per_repeat),
                                           "max": max(per_repeat), "n": len(per_repeat)},
                       "vs_own_plain": statistics.median(r["tok_s"] / p["tok_s"] for r, p in zip(rs, own_plain)),
                       "ms_per_token": {k: statistics.median(r["ms_per_token"][k] for r in rs) for k in PHASES}}
        e = table[name]
        print(f"{name:58s} {e['tok_s']['median']:6.1f} tok/s  {e['vs_onednn_plain']['median']:.2f}x plain on oneDNN "
              f"({min(per_repeat):.2f}-{max(per_repeat):.2f})  {e['vs_own_plain']:.2f}x its own plain  "
              f"target {e['ms_per_token']['target']:.2f} ms/token")
    path = write("one_sequence_kernel", {"workload": args.workload, "prompts": len(prompts), "tokens": args.tokens,
                                         "repeats": args.repeats, "batch": 1, "temperature": 0.0,
                                         "draft_quantization": args.draft_quantization, "results": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
