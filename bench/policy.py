"""The adaptive policy against plain decoding and every fixed K on the traffic a server sees: one
grid of (proposer, workload, batch), every variant interleaved in each cell with an A/A pair.

    python -m bench policy                          # the whole grid (under an hour on 2 cores)
    python -m bench policy --cells hybrid:mix eagle:code0 --batches 16 32
    python -m bench policy --smoke                  # the mix at batch 2, 4 tokens, 2 repeats (the test suite)

Workloads (bench/workloads.py's held-out prompts): `code0` code at T = 0, `code08` code at T = 0.8,
`edit` edits at T = 0, `agent` agent turns (tool calls as JSON after the code and edit prompts) at
T = 0, `mix` edits at T = 0 beside code at T = 0.8 (bench mixed's batch). Every cell speculates by
`hybrid` (prompt lookup, else the EAGLE-3 head); `eagle` (the head alone) on code too.

Variants: plain (the same engine and forward plan, speculation off), fixed K = 1-4, the one-K
adaptive policy twice (the A/A pair: the noise floor) and the per-request policy. Figures, per
cell: end-to-end tok/s first (every request submitted at once, run to its max_tokens with
ignore_eos, prefill and drain included), the window second (bench sweep's: while every request
is in flight); adaptive ÷ plain and adaptive ÷ the best fixed K, that best picked on the other
repeats (sweep.held_out_ratios), never on the run it is judged by; and, per proposer, the policy's
own prediction check over the whole grid (stats()["self_check"]: Σpredicted ÷ Σrealized at every
(batch, K chosen) with at least PREDICTION_STEPS steps).
"""

from __future__ import annotations

import itertools
import statistics

import torch

from bench.batch_run import PREFILL_BUDGET, run_batch
from bench.common import PLAIN, adaptive, fixed, host_class, interleave, parser, summarize, write
from bench.mixed import HIGH_TEMPERATURE, batch_of
from bench.sweep import held_out_ratios
from bench.workloads import agent_prompts, load_prompts

WORKLOADS = ("code0", "code08", "edit", "agent", "mix")
CELLS = {"hybrid": WORKLOADS, "eagle": ("code0", "code08")}
BATCHES = (1, 4, 16, 64)
MIX_BATCHES = (1, 4, 16, 32, 64)
FIXED_KS = (1, 2, 3, 4)
ADAPTIVE, AA, PER_REQUEST = "adaptive", "adaptive (A/A)", "per-request"
PREDICTION_STEPS = 200  # the self-check is judged at a (batch, K) with at least this many steps


def variants(method: str) -> dict[str, dict]:
    """reconfigure_speculation() settings by variant name."""
    one_k = {**adaptive(method), "k_per_request": False}
    return {"plain": PLAIN, **{f"K={k}": fixed(method, k) for k in FIXED_KS}, ADAPTIVE: one_k, AA: one_k,
            PER_REQUEST: {**one_k, "k_per_request": True}}


def cell_batch(workload: str, batch: int, repeat: int, tokens: int) -> tuple[list[str], list]:
    """Repeat `repeat`'s prompts and SamplingParams for a cell (the pool's next prompts each repeat)."""
    from engine import SamplingParams

    if workload == "mix":
        return batch_of("mix", batch, repeat, tokens)
    pool = agent_prompts() if workload == "agent" else load_prompts("edit" if workload == "edit" else "code")
    hot = workload == "code08"
    params = SamplingParams(temperature=HIGH_TEMPERATURE if hot else 0.0, max_tokens=tokens, ignore_eos=True,
                            seed=0 if hot else None)
    return [pool[(repeat * batch + i) % len(pool)] for i in range(batch)], [params] * batch


def run_cell(llm, method: str, workload: str, batch: int, args) -> dict:
    """Every variant of one cell, interleaved; medians, ranges and the ratios the grid judges by."""
    settings = {n: s for n, s in variants(method).items() if n in args.variants}

    def variant(cfg):
        repeats = itertools.count()

        def go():
            llm.engine.reconfigure_speculation(**cfg)
            out = run_batch(llm, *cell_batch(workload, batch, next(repeats), args.tokens))
            out.pop("tokens")
            return out
        return go

    llm.engine.reconfigure_speculation(**PLAIN)
    run_batch(llm, *cell_batch(workload, batch, 0, args.tokens))  # warm-up
    runs = interleave({n: variant(s) for n, s in settings.items()}, args.repeats, f"{method} {workload} {batch}")
    row = {"variants": {n: {"end_to_end": summarize(rs, "tok_s_end_to_end"), "window": summarize(rs, "tok_s"),
                            "k_steps": _k_steps(rs)} for n, rs in runs.items()}}
    row["ratios"] = ratios(runs)
    return row


def ratios(runs: dict[str, list[dict]]) -> dict:
    """Adaptive ÷ plain, ÷ the best fixed K (held out) and the A/A pair, per repeat, end to end and
    in the window: median and range of each."""
    out = {}
    for figure, key in (("end_to_end", "tok_s_end_to_end"), ("window", "tok_s")):
        keyed = {n: [{"tok_s": r[key]} for r in rs] for n, rs in runs.items()}
        row = {}
        if "plain" in keyed and ADAPTIVE in keyed:
            row["adaptive_vs_plain"] = _spread([a["tok_s"] / p["tok_s"] for a, p in zip(keyed[ADAPTIVE], keyed["plain"])])
        fixed_and_adaptive = {n: rs for n, rs in keyed.items() if n.startswith("K=") or n == ADAPTIVE}
        if len(fixed_and_adaptive) > 1 and len(keyed[ADAPTIVE]) > 1:
            row["adaptive_vs_best_fixed"] = _spread(held_out_ratios(fixed_and_adaptive, ADAPTIVE))
        if AA in keyed:
            row["aa"] = _spread([a["tok_s"] / b["tok_s"] for a, b in zip(keyed[AA], keyed[ADAPTIVE])])
        if PER_REQUEST in keyed:
            row["per_request_vs_adaptive"] = _spread([a["tok_s"] / b["tok_s"]
                                                      for a, b in zip(keyed[PER_REQUEST], keyed[ADAPTIVE])])
        out[figure] = row
    return out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _k_steps(runs: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in runs:
        for k, n in r["k_steps"].items():
            total[str(k)] = total.get(str(k), 0) + n
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def geomean(values: list[float]) -> float:
    return statistics.geometric_mean(values) if values else float("nan")


def table(r: dict) -> list[str]:
    """The results page's section: one row per cell, end to end first."""
    lines = ["### The adaptive policy on a server's traffic (`python -m bench policy`)", "",
             f"{r['tokens']} tokens a request, {r['repeats']} interleaved repeats, medians [range]; best fixed K "
             "picked on the other repeats. End to end first, the window second." + _host(r.get("machine")), "",
             "| proposer | workload | batch | adaptive ÷ plain | adaptive ÷ best fixed | A/A | per-request ÷ adaptive "
             "| window: adaptive ÷ plain |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(d: dict | None) -> str:
        return "—" if not d else f"{d['median']:.3f} [{d['min']:.2f}, {d['max']:.2f}]"
    vs_plain, vs_best = [], []
    for key, row in r["cells"].items():
        method, workload, batch = key.split(":")
        e2e, win = row["ratios"]["end_to_end"], row["ratios"]["window"]
        vs_plain += [e2e["adaptive_vs_plain"]["median"]] if "adaptive_vs_plain" in e2e else []
        vs_best += [e2e["adaptive_vs_best_fixed"]["median"]] if "adaptive_vs_best_fixed" in e2e else []
        lines.append(f"| {method} | {workload} | {batch} | {cell(e2e.get('adaptive_vs_plain'))} | "
                     f"{cell(e2e.get('adaptive_vs_best_fixed'))} | {cell(e2e.get('aa'))} | "
                     f"{cell(e2e.get('per_request_vs_adaptive'))} | {cell(win.get('adaptive_vs_plain'))} |")
    lines += ["", f"Geometric means over the grid, end to end: adaptive ÷ plain {geomean(vs_plain):.3f}, "
              f"adaptive ÷ best fixed {geomean(vs_best):.3f}.", ""]
    return lines + prediction_table(r.get("self_check") or {})


def _host(machine: dict | None) -> str:
    return f" {host_class(machine)}, measured {machine['time'][:10]}." if machine else ""


def prediction_table(checks: dict[str, list[dict]]) -> list[str]:
    """The self-check over the grid: Σpredicted ÷ Σrealized per (batch, K chosen) with at least
    PREDICTION_STEPS steps, every variant's steps together."""
    rows = [(m, c) for m, cs in checks.items() for c in cs if c["steps"] >= PREDICTION_STEPS]
    if not rows:
        return []
    lines = [f"Predicted ÷ realized over the grid, at every (batch, K chosen) with at least {PREDICTION_STEPS} "
             "steps:", "", "| proposer | batch | K | steps | tokens | seconds | draft | verify | other |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m, c in rows:
        cells = [c[q]["ratio"] for q in ("tokens", "seconds", "draft", "verify", "other")]
        lines.append(f"| {m} | {c['batch']} | {c['k']} | {c['steps']} | "
                     + " | ".join("—" if v is None else f"{v:.3f}" for v in cells) + " |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    ap = parser("policy", __doc__, tokens=64)
    ap.set_defaults(repeats=5)
    ap.add_argument("--cells", nargs="+", default=[f"{m}:{w}" for m, ws in CELLS.items() for w in ws],
                    help="method:workload pairs (default: the whole grid)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 4 16 64 (and 32 for the mix)")
    ap.add_argument("--variants", nargs="+", default=list(variants("hybrid")), choices=list(variants("hybrid")))
    ap.add_argument("--smoke", action="store_true", help="the mix at batch 2, 4 tokens, 2 repeats")
    ap.add_argument("--out", default="policy", help="results name (bench/results/<out>.json)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.cells, args.batches, args.tokens, args.repeats = ["hybrid:mix"], [2], 4, 2
    torch.set_num_threads(args.threads)
    from engine import LLM

    engines, cells = {}, {}
    for spec in args.cells:
        method, workload = spec.split(":")
        if method not in CELLS or workload not in WORKLOADS:
            raise SystemExit(f"unknown cell {spec!r}: method one of {sorted(CELLS)}, workload one of {WORKLOADS}")
        if method not in engines:
            engines[method] = LLM(model=args.target, draft_model="embedded:eagle3", forward_plan=args.forward_plan,
                                  speculative_method=method, max_batch_size=max(args.batches or MIX_BATCHES),
                                  max_seq_len=1024, enable_prefix_caching=False, max_num_batched_tokens=PREFILL_BUDGET)
        for batch in args.batches or (MIX_BATCHES if workload == "mix" else BATCHES):
            row = cells[f"{method}:{workload}:{batch}"] = run_cell(engines[method], method, workload, batch, args)
            e2e = row["ratios"]["end_to_end"]
            print(f"{method} {workload} batch {batch}: " + ", ".join(
                f"{name} {d['median']:.3f}" for name, d in e2e.items()), flush=True)
    payload = {"tokens": args.tokens, "repeats": args.repeats, "cells": cells,
               "self_check": {m: [r for r in llm.engine.stats().get("self_check") or [] if r["steps"] >= 20]
                              for m, llm in engines.items()}}
    print("\n".join(table(payload)))
    print(f"wrote {write(args.out, payload, next(iter(engines.values())))}")



if __name__ == "__main__":
    main()
