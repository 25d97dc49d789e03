"""Two explicit draft forward plans side by side at one batch size, as the sweep measures it.

    python tools/plan_ab.py --method draft --batch 16 --repeats 5 \
        --plans '{"dtype": "float32", "token_step": true}' \
                '{"dtype": "float32", "token_step": true, "token_step_rows": 16}'

Each plan gets its own engine (the target's plan is the same explicit one); plain decoding, fixed
K = 2 and the adaptive policy run interleaved (bench.sweep.run_batch: decode throughput while all
requests are in flight); prints medians and the second plan's paired ratios over the first's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PLAIN, adaptive, fixed, host_class, interleave  # noqa: E402
from bench.sweep import run_batch  # noqa: E402
from bench.workloads import load_prompts  # noqa: E402

TARGET_PLAN = {"dtype": "float32", "one_sequence_kernel": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=["draft", "eagle"], default="draft")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--plans", nargs=2, type=json.loads, required=True, help="two draft plans (JSON objects)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from engine import LLM, SamplingParams

    prompts = (load_prompts("code") + load_prompts("edit"))[:args.batch]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    draft = "embedded:eagle3" if args.method == "eagle" else "embedded:draft"
    llms = [LLM(model="embedded:target", draft_model=draft, use_speculative_decoding=True,
                speculative_method=args.method, max_batch_size=max(16, args.batch), max_seq_len=1024,
                enable_prefix_caching=False, max_num_batched_tokens=2048,
                forward_plan={"target": TARGET_PLAN, "draft": plan}) for plan in args.plans]

    def variant(i: int, cfg: dict):
        def go():
            llms[i].engine.reconfigure_speculation(**cfg)
            return run_batch(llms[i], prompts, params)
        return go

    variants = {"plain": variant(0, PLAIN)}
    for i in (0, 1):
        variants[f"K=2, plan {i}"] = variant(i, fixed(args.method, 2))
        variants[f"adaptive, plan {i}"] = variant(i, adaptive(args.method))
    variants["plain"]()  # warm-up
    runs = interleave(variants, args.repeats, f"batch {args.batch}")
    print(f"{host_class()}; plans: {args.plans}")
    for name, rs in runs.items():
        tok_s = [r["tok_s"] for r in rs]
        ks = Counter()
        for r in rs:
            ks.update(r["k_steps"])
        print(f"{name}: {statistics.median(tok_s):.0f} tok/s ({min(tok_s):.0f}-{max(tok_s):.0f}), draft "
              f"{statistics.median(r['window_ms_per_token']['draft'] for r in rs):.3f} ms/token, K steps {dict(sorted(ks.items()))}")
    for kind in ("K=2", "adaptive"):
        ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(runs[f"{kind}, plan 0"], runs[f"{kind}, plan 1"])]
        print(f"{kind}: plan 1 / plan 0 paired median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
