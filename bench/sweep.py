"""Batch sweep: throughput of plain decode, fixed-K speculation and the adaptive policy at 1..64
concurrent requests, and which K the adaptive policy picked at each batch size.

    python -m bench sweep [--batches 1 2 4 8 16 32 64] [--tokens 128] [--repeats 3]
    python -m bench sweep --method eagle      # the EAGLE-3 head (embedded:eagle3) instead of the draft

All requests of a run are submitted at once (distinct held-out prompts: code, then edit) and the
engine steps until all finish. Throughput at batch B (`tok_s`) is decode throughput while all B
requests are in flight: tokens emitted from the second decode step after every request has its first
token (the first is the catch-up, below), up to and including the step in which the first request
finishes, over those steps' wall time. That leaves out the prefill (paid once by every variant) and
the drain at the end, where speculative runs finish requests at different steps and the batch
shrinks below B while plain decoding keeps all B to the last step; a sweep over batch sizes should
not mix batch sizes. Every batch's prompts prefill in one step (the token budget holds them all), so
a proposer's catch-up on the prompts (an EAGLE-3 head reads them before it can propose) falls in the
first decode step, which is left out for every variant: it is paid once a run, while the window's
length in tokens depends on K (it closes when the fastest request finishes), so inside it the cost
weighed more on variants choosing long rounds (docs/performance-notes.md, "The sweep's window leaves
out the catch-up step"). If the adaptive policy decodes plainly in that step, it pays the catch-up
inside the window. The whole run, prefill and drain included, is reported too (`tok_s_end_to_end`).
128 new tokens by default: at 64 the window of fixed K = 4 spans about 15 steps (0.2 s at batch 1),
and the host's swings over so short a window outweighed the few percent the sweep is to judge.
Variants are interleaved (A B C, C B A, ...) within each batch size; medians reported.
Repeat r of batch B decodes the B prompts after those of repeat r - 1 (the pool wraps), the same
for every variant of that repeat: greedy text is deterministic, so with one prompt the same few
tokens fall at each draft position in every repeat, and at batch 1 a fixed K whose round
boundaries happen to suit that one text beat the others by more than the choice of K is worth.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter

import torch

from bench.common import PLAIN, adaptive, fixed, interleave, parser, summarize, write
from bench.workloads import load_prompts
from engine.request import PHASES

PREFILL_BUDGET = 8192  # tokens a step may take: every batch's prompts in one step (4,744 at batch 64)


def method_variants(method: str) -> dict[str, dict]:
    """Plain, fixed K = 1, 2, 4 and adaptive speculation by `method` ("draft" or "eagle")."""
    return {"plain": PLAIN, **{f"{method} K={k}": fixed(method, k) for k in (1, 2, 4)},
            f"{method} adaptive": adaptive(method)}


def repeat_prompts(pool: list[str], batch: int, repeat: int) -> list[str]:
    """The `batch` prompts of repeat `repeat`: the pool's next ones after the previous repeat's, wrapping."""
    start = repeat * batch
    return [pool[(start + i) % len(pool)] for i in range(batch)]


def held_out_ratios(runs: dict[str, list[dict]], adaptive: str) -> list[float]:
    """Per repeat r: the adaptive run r over run r of the variant whose median over the other
    repeats is best. Picking the best of several near-tied medians picks the luckiest, so a best
    picked and judged on the same runs favours the fixed side; picked on the other repeats, it is
    the choice one would have made without seeing run r. Needs at least 2 repeats."""
    others = [name for name in runs if name != adaptive]
    ratios = []
    for r, run in enumerate(runs[adaptive]):
        def rest(name, r=r):
            return statistics.median(x["tok_s"] for i, x in enumerate(runs[name]) if i != r)
        ratios.append(run["tok_s"] / runs[max(others, key=rest)][r]["tok_s"])
    return ratios


def run_batch(llm, prompts: list[str], params) -> dict:
    """Submits every prompt (`params`: one SamplingParams for all, or one per prompt), steps to
    completion; returns throughputs and the K chosen per step."""
    engine = llm.engine
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, per_prompt, strict=True)]
    ks: Counter[int] = Counter()  # decode steps by the K they used (0 = plain decode)
    window_ks: Counter[int] = Counter()  # ... of those, the steps inside the window
    started: set[str] = set()  # requests with their first token
    window_tokens, window_seconds, window_steps = 0, 0.0, 0
    window_phases = dict.fromkeys(PHASES, 0.0)  # where the window's step time went
    # "before" the last first token; "catch_up": the step after it, where a model proposer reads
    # the prompts; "open" while all are in flight; "closed" from the step that finishes a request
    window = "before"
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        t_step = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - t_step
        in_window = window == "open"
        if in_window:
            window_tokens += len(outputs)
            window_seconds += seconds
            window_steps += 1
            for phase, sec in engine.last_step.phases.items():
                window_phases[phase] += sec
        if any(o.finished for o in outputs):
            window = "closed"
        elif window == "catch_up":
            window = "open"
        elif window == "before":
            started.update(o.request_id for o in outputs)
            if len(started) == len(ids):
                window = "catch_up"
        stats = engine.last_step.decode
        if stats is not None:  # None: the step decoded nothing (prefill only)
            ks[stats.k] += 1
            if in_window:
                window_ks[stats.k] += 1
    dt = time.perf_counter() - t0
    outs = [engine.get_output(rid) for rid in ids]
    for rid in ids:
        engine.release(rid)
    drafted = sum(o.num_draft_tokens for o in outs)
    total = sum(len(o.token_ids) for o in outs)
    return {"tok_s": window_tokens / window_seconds if window_seconds else total / dt,
            "tok_s_end_to_end": total / dt, "window_steps": window_steps, "k_steps": dict(ks),
            "window_k_steps": dict(window_ks),
            "window_ms_per_token": {ph: sec * 1e3 / window_tokens for ph, sec in window_phases.items()}
            if window_tokens else None,
            "acceptance": sum(o.num_accepted_tokens for o in outs) / drafted if drafted else None,
            "tokens": [o.token_ids for o in outs]}


def main(argv: list[str] | None = None) -> None:
    ap = parser("sweep", __doc__, tokens=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--method", choices=["draft", "eagle"], default="draft",
                    help="the model proposer (eagle: --draft defaults to the embedded EAGLE-3 head)")
    args = ap.parse_args(argv)
    if args.method == "eagle" and args.draft == "embedded:draft":
        args.draft = "embedded:eagle3"
    VARIANTS = method_variants(args.method)
    ADAPTIVE = f"{args.method} adaptive"
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams

    pool = load_prompts("code") + load_prompts("edit")
    if max(args.batches) > len(pool):
        raise SystemExit(f"at most {len(pool)} distinct prompts; got batch {max(args.batches)}")
    llm = LLM(model=args.target, draft_model=args.draft, forward_plan=args.forward_plan,
              use_speculative_decoding=True, speculative_method=args.method,
              max_batch_size=max(args.batches), max_seq_len=1024, enable_prefix_caching=False,
              max_num_batched_tokens=PREFILL_BUDGET)
    longest = sorted((len(llm.engine.tokenize_prompt(p)) for p in pool), reverse=True)
    prompt_tokens = sum(longest[:max(args.batches)])
    if prompt_tokens > PREFILL_BUDGET:
        raise SystemExit(f"batch {max(args.batches)}'s prompts (up to {prompt_tokens} tokens) may not prefill in one "
                         f"step of {PREFILL_BUDGET} tokens")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    results = {}
    for b in args.batches:
        def variant(cfg, b=b):
            repeats = itertools.count()  # interleave calls each variant once a repeat

            def go():
                llm.engine.reconfigure_speculation(**cfg)
                return run_batch(llm, repeat_prompts(pool, b, next(repeats)), params)
            return go

        llm.engine.reconfigure_speculation(**PLAIN)
        run_batch(llm, pool[:b], params)  # warm-up
        runs = interleave({name: variant(cfg) for name, cfg in VARIANTS.items()}, args.repeats, f"batch {b}")
        if any(r["window_steps"] == 0 for rs in runs.values() for r in rs):
            print(f"batch {b}: a request finished before the window opened, so some runs report the whole run's "
                  "tok/s (raise --tokens)")
        plain = summarize(runs["plain"], "tok_s")["median"]
        row = {}
        for name, rs in runs.items():
            s = summarize(rs, "tok_s")
            end_to_end = summarize(rs, "tok_s_end_to_end")
            ks: Counter[int] = Counter()
            window_ks: Counter[int] = Counter()
            for r in rs:
                ks.update(r["k_steps"])
                window_ks.update(r["window_k_steps"])
            row[name] = {"tok_s": s, "vs_plain": s["median"] / plain, "tok_s_end_to_end": end_to_end,
                         "window_steps": statistics.median(r["window_steps"] for r in rs),
                         "acceptance": rs[0]["acceptance"],
                         "window_ms_per_token": {ph: statistics.median(r["window_ms_per_token"][ph] for r in rs)
                                                 for ph in PHASES} if all(r["window_ms_per_token"] for r in rs)
                         else None,
                         "k_steps": {str(k): n for k, n in sorted(ks.items())},
                         "window_k_steps": {str(k): n for k, n in sorted(window_ks.items())},
                         "identical_to_plain": statistics.fmean(
                             a == b for r, p in zip(rs, runs["plain"]) for a, b in zip(r["tokens"], p["tokens"]))}
        best_fixed = max((n for n in row if n != ADAPTIVE), key=lambda n: row[n]["tok_s"]["median"])
        row["adaptive_vs_best"] = row[ADAPTIVE]["tok_s"]["median"] / row[best_fixed]["tok_s"]["median"]
        # paired: each repeat's adaptive run over the same repeat's run of that best variant (the
        # two ran minutes apart, not a whole sweep apart), so slow drifts of the host cancel
        row["adaptive_vs_best_paired"] = summarize(
            [{"r": a["tok_s"] / f["tok_s"]} for a, f in zip(runs[ADAPTIVE], runs[best_fixed])], "r")
        row["best_fixed"] = best_fixed
        held_out = ""
        if args.repeats >= 2:
            row["adaptive_vs_best_held_out"] = summarize([{"r": x} for x in held_out_ratios(runs, ADAPTIVE)], "r")
            held_out = f", held out {row['adaptive_vs_best_held_out']['median']:.3f}"
        best_e2e = max(row[n]["tok_s_end_to_end"]["median"] for n in VARIANTS if n != ADAPTIVE)
        row["adaptive_vs_best_end_to_end"] = row[ADAPTIVE]["tok_s_end_to_end"]["median"] / best_e2e
        results[str(b)] = row
        print(f"batch {b:3d}: " + "  ".join(f"{n} {row[n]['tok_s']['median']:.0f}" for n in VARIANTS)
              + f"  tok/s; adaptive / best ({best_fixed}) = {row['adaptive_vs_best']:.3f} "
              f"(paired median {row['adaptive_vs_best_paired']['median']:.3f}"
              + held_out + "); "
              f"(end to end {row['adaptive_vs_best_end_to_end']:.3f}); "
              f"adaptive K steps in the window {row[ADAPTIVE]['window_k_steps']} (whole run {row[ADAPTIVE]['k_steps']})")
    payload = {"tokens": args.tokens, "repeats": args.repeats, "temperature": 0.0, "prefill_budget": PREFILL_BUDGET,
               "prompts_per_repeat": "next", "window": "after_catch_up", "variants": VARIANTS, "results": results}
    path = write("sweep" if args.method == "draft" else f"sweep_{args.method}", payload, llm)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
