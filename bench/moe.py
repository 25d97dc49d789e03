"""A mixture of experts on CPU: a reduced Qwen3-MoE (the real routing: 128 experts, top 8; four
narrow layers) made a realistic-acceptance pair with its one-layer prefix draft, our engine plain,
at fixed K and adaptive, interleaved, at batch 1 to 32, beside transformers' `generate` on the same
weights (float32, greedy).

    python -m bench moe [--repeats 3] [--tokens 32] [--batches 1 8 32]

Writes bench/results/moe_cpu.json. On a GPU: `python -m bench gpu --sections moe`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench import tables
from bench.common import host_class, machine, write
from bench.gpu.context import Context
from bench.gpu.moe import measure
from bench.random_checkpoints import REDUCED_MOE


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--out", default="moe_cpu", help="results name under bench/results")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        ctx = Context(device="cpu", smoke=False, work=Path(work))
        out = measure(ctx, REDUCED_MOE, keep=1, batches=tuple(args.batches), new_tokens=args.tokens,
                      repeats=args.repeats, with_transformers=True)
    for batch, row in out["batches"].items():
        hf = row["transformers_tok_s"]["median"]
        print(f"batch {batch}: " + ", ".join(
            f"{n} {v['tok_s']['median']:.1f} tok/s ({v['tok_s']['min']:.1f}-{v['tok_s']['max']:.1f}; ÷ transformers "
            f"{v['tok_s']['median'] / hf:.2f}x)" for n, v in row["variants"].items())
            + f"; transformers {hf:.1f} tok/s; adaptive ÷ best fixed ({row['best_fixed']}) "
              f"{row['adaptive_over_best_fixed']:.3f}; per-request K ÷ one K {row['per_request_over_adaptive']:.3f}; "
              f"same tokens {row['same_tokens']}")
    print(f"pair: {out['pair']['teacher_forced']}")
    print(f"host: {host_class(machine())}")
    print(f"wrote {write(args.out, {'shape': 'reduced Qwen3-MoE', 'repeats': args.repeats, **out})}")


def draw(r: dict) -> list[str]:
    lines = [f"**A mixture of experts** — {r['shape']} (128 experts, top 8), a pair at greedy alpha "
             f"{r['pair']['teacher_forced']['greedy']:.2f} with its one-layer prefix draft, float32, greedy, "
             f"{r['repeats']} interleaved repeats, median tok/s [range]; {tables.host(r['machine'])} (`python -m bench moe`).", "",
             "| batch | transformers | plain | fixed K = 2 | fixed K = 4 | adaptive | adaptive ÷ best fixed K |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for batch, row in r["batches"].items():
        v = row["variants"]
        cells = [f"{v[n]['tok_s']['median']:.0f} [{v[n]['tok_s']['min']:.0f}, {v[n]['tok_s']['max']:.0f}]"
                 for n in ("plain", "fixed K=2", "fixed K=4", "adaptive")]
        lines.append(f"| {batch} | {row['transformers_tok_s']['median']:.0f} | {' | '.join(cells)} | "
                     f"{row['adaptive_over_best_fixed']:.3f} |")
    return lines + [""]

