"""A mixed batch: half the requests accept a lot (edit prompts, greedy), half little (free code at
T = 0.8), sent together, speculating by `hybrid` (prompt lookup, else the EAGLE-3 head).

    python -m bench mixed [--batches 4 8 16 32 64] [--tokens 96] [--repeats 3]
    python -m bench mixed --halves            # the ceiling: each half alone, plain / fixed K / adaptive
    python -m bench mixed --workload edit     # a uniform batch (all edits, or all code) instead of the mix

Variants, interleaved (A B C, C B A, ...) per batch size: plain, one K a step (the adaptive policy
as before per-request K), the same again (an A/A pair: the noise floor) and a K per request
(`k_per_request`); with --oracle, fixed K per kind of request through each request's own
`spec_length` (edits 4 and code 0, ...: what a perfect allocation could choose from). Throughput
is sweep.py's window (decode tokens while all requests are in flight, after the proposer's
catch-up step) and end to end (`tok_s_end_to_end`: prefill and drain included). `--halves` runs each half alone at half the batch,
plain, fixed K and adaptive: the best a single K can do for it.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from bench import tables
from bench.batch_run import PREFILL_BUDGET, run_batch
from bench.common import PLAIN, adaptive, fixed, interleave, parser, summarize, write
from bench.workloads import load_prompts

HIGH_TEMPERATURE = 0.8  # the low-acceptance half samples at this temperature
ONE_K = adaptive("hybrid")
PER_REQUEST = {**ONE_K, "k_per_request": True}
VARIANTS = {"plain": PLAIN, "one K": ONE_K, "one K (A/A)": ONE_K, "per-request K": PER_REQUEST}
# fixed K per kind of request, through each request's own spec_length cap: the allocations a perfect
# per-request policy could pick from (--oracle)
ORACLE = {f"fixed: edits {e}, code {c}": (e, c) for e, c in ((4, 0), (4, 2), (3, 3))}
HALF_VARIANTS = {"edit": {"plain": PLAIN, **{f"K={k}": fixed("hybrid", k) for k in (2, 4, 6)}, "adaptive": ONE_K},
                 "code": {"plain": PLAIN, **{f"K={k}": fixed("hybrid", k) for k in (1, 2, 3)}, "adaptive": ONE_K}}


def batch_of(workload: str, batch: int, repeat: int, tokens: int, caps: tuple[int, int] | None = None
             ) -> tuple[list[str], list]:
    """Repeat `repeat`'s prompts and SamplingParams: `batch` of the workload ("mix": edits greedy and
    code at HIGH_TEMPERATURE alternating), each pool's next prompts after the previous repeat's;
    caps: (edits', code's) spec_length."""
    from engine import SamplingParams

    edit_cap, code_cap = caps or (None, None)
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, spec_length=edit_cap)
    hot = SamplingParams(temperature=HIGH_TEMPERATURE, max_tokens=tokens, ignore_eos=True, seed=0, spec_length=code_cap)
    kinds = {"mix": ["edit", "code"] * (batch // 2) + ["edit"] * (batch % 2), "edit": ["edit"] * batch,
             "code": ["code"] * batch}[workload]
    pools = {"edit": load_prompts("edit"), "code": load_prompts("code")}
    taken: Counter[str] = Counter()
    prompts, params = [], []
    for kind in kinds:
        pool = pools[kind]
        prompts.append(pool[(repeat * batch + taken[kind]) % len(pool)])
        params.append(greedy if kind == "edit" else hot)
        taken[kind] += 1
    return prompts, params


def run_variants(llm, variants: dict[str, dict], workload: str, batch: int, args,
                 oracle: dict[str, tuple[int, int]] | None = None) -> dict:
    """Each variant's runs at this batch, interleaved (and the oracle's fixed K per kind);
    medians and ratios to plain and to one K."""
    def variant(cfg, caps=None):
        repeats = itertools.count()

        def go():
            llm.engine.reconfigure_speculation(**cfg)
            return run_batch(llm, *batch_of(workload, batch, next(repeats), args.tokens, caps))
        return go

    llm.engine.reconfigure_speculation(**PLAIN)
    run_batch(llm, *batch_of(workload, batch, 0, args.tokens))  # warm-up
    calls = {name: variant(cfg) for name, cfg in variants.items()}
    calls.update({name: variant(fixed("hybrid", max(caps)), caps) for name, caps in (oracle or {}).items()})
    runs = interleave(calls, args.repeats, f"{workload} {batch}")
    row = {name: {"tok_s": summarize(rs, "tok_s"), "tok_s_end_to_end": summarize(rs, "tok_s_end_to_end"),
                  "window_k_steps": _k_steps(rs)} for name, rs in runs.items()}
    for name, rs in runs.items():
        row[name]["vs_plain"] = summarize([{"r": a["tok_s"] / p["tok_s"]} for a, p in zip(rs, runs["plain"])], "r")
        row[name]["end_to_end_vs_plain"] = summarize([{"r": a["tok_s_end_to_end"] / p["tok_s_end_to_end"]}
                                                      for a, p in zip(rs, runs["plain"])], "r")
        if "one K" in runs:
            row[name]["vs_one_k"] = summarize([{"r": a["tok_s"] / b["tok_s"]} for a, b in zip(rs, runs["one K"])], "r")
    return row


def _k_steps(runs: list[dict]) -> dict[str, int]:
    ks: Counter[int] = Counter()
    for r in runs:
        ks.update(r["window_k_steps"])
    return {str(k): n for k, n in sorted(ks.items())}


def main(argv: list[str] | None = None) -> None:
    ap = parser("mixed", __doc__, tokens=96)
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--workload", choices=["mix", "edit", "code"], default="mix")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--oracle", action="store_true", help="add fixed K per kind of request (the mix only)")
    ap.add_argument("--halves", action="store_true", help="each half alone at half the batch (the ceiling)")
    ap.add_argument("--eagle", default="embedded:eagle3", help="the EAGLE-3 head hybrid falls back to")
    ap.add_argument("--out", default=None, help="results name (default: mixed_<workload>, or mixed_halves)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import LLM

    llm = LLM(model=args.target, draft_model=args.eagle, forward_plan=args.forward_plan, speculative_method="hybrid",
              max_batch_size=max(args.batches), max_seq_len=1024, enable_prefix_caching=False,
              max_num_batched_tokens=PREFILL_BUDGET)
    results = {}
    for b in args.batches:
        if args.halves:
            results[str(b)] = {half: run_variants(llm, HALF_VARIANTS[half], half, max(1, b // 2), args)
                               for half in ("edit", "code")}
            line = "  ".join(f"{half}: " + " ".join(f"{n} {v['vs_plain']['median']:.2f}x" for n, v in row.items())
                             for half, row in results[str(b)].items())
        else:
            results[str(b)] = row = run_variants(llm, {n: VARIANTS[n] for n in args.variants}, args.workload, b, args,
                                                 ORACLE if args.oracle and args.workload == "mix" else None)
            line = "  ".join(f"{n} {v['tok_s']['median']:.0f} tok/s ({v['vs_plain']['median']:.2f}x plain, "
                             f"{v.get('vs_one_k', {}).get('median', 1):.3f}x one K)" for n, v in row.items())
        print(f"batch {b:3d}: {line}", flush=True)
    name = args.out or ("mixed_halves" if args.halves else f"mixed_{args.workload}")
    payload = {"workload": args.workload, "halves": args.halves, "tokens": args.tokens, "repeats": args.repeats,
               "high_temperature": HIGH_TEMPERATURE, "prefill_budget": PREFILL_BUDGET, "results": results}
    print(f"wrote {write(name, payload, llm)}")


def _table(r: dict, halves: dict | None) -> list[str]:
    """A K per request on the mixed batch (and uniform ones): each variant ÷ plain, and per-request ÷ one K."""
    workload = {"mix": "edits greedy and code at T = 0.8, half each", "edit": "all edits (greedy)",
                "code": "all code at T = 0.8"}[r["workload"]]
    names = list(next(iter(r["results"].values())))
    lines = [f"**A K per request, {workload}** — `hybrid` (prompt lookup, else the EAGLE-3 head), "
             f"{r['tokens']} tokens a request, {r['repeats']} interleaved repeats: median tok/s ÷ plain, and "
             f"per-request K ÷ one K paired per repeat, median [range]; {tables.host(r['machine'])} "
             f"(`python -m bench mixed --workload {r['workload']}`).", "",
             "| batch | " + " | ".join(names) + " | per-request ÷ one K |", "| --- " * (len(names) + 2) + "|"]
    for batch, row in r["results"].items():
        paired = row["per-request K"]["vs_one_k"]
        lines.append(f"| {batch} | " + " | ".join(f"{row[n]['tok_s']['median']:.0f} ({row[n]['vs_plain']['median']:.2f}x)"
                                                for n in names)
                     + f" | {paired['median']:.3f} [{paired['min']:.3f}, {paired['max']:.3f}] |")
    if halves is not None and r["workload"] == "mix":
        lines += ["", "Each half alone at half the batch (the ceiling a single K reaches for it), best ÷ plain:", "",
                  "| batch | edits: best | code: best |", "| --- | --- | --- |"]
        for batch, row in halves["results"].items():
            cells = []
            for half in ("edit", "code"):
                best = max(row[half], key=lambda n: row[half][n]["tok_s"]["median"])
                cells.append(f"{best} {row[half][best]['vs_plain']['median']:.2f}x")
            lines.append(f"| {batch} | {' | '.join(cells)} |")
    return lines + [""]


def page_table() -> list[str]:
    """The results page's tables: each mixed run's, the mix with its halves' ceilings."""
    out = []
    for name in ("mixed_mix", "mixed_edit", "mixed_code"):
        if (r := tables.load(name)) is not None:
            out += _table(r, tables.load("mixed_ceiling_halves"))
    return out


if __name__ == "__main__":
    main()
