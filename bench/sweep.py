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
from collections import Counter

import torch

from bench import tables
from bench.batch_run import PREFILL_BUDGET, run_batch
from bench.common import PLAIN, adaptive, fixed, interleave, parser, summarize, write
from bench.workloads import load_prompts
from engine.request import PHASES


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


def _variant_row(rs: list[dict], plain_runs: list[dict], plain: float) -> dict:
    """One variant's figures at one batch size, over its repeats."""
    s = summarize(rs, "tok_s")
    ks: Counter[int] = Counter()
    window_ks: Counter[int] = Counter()
    for r in rs:
        ks.update(r["k_steps"])
        window_ks.update(r["window_k_steps"])
    return {"tok_s": s, "vs_plain": s["median"] / plain, "tok_s_end_to_end": summarize(rs, "tok_s_end_to_end"),
            "window_steps": statistics.median(r["window_steps"] for r in rs),
            "acceptance": rs[0]["acceptance"],
            "window_ms_per_token": {ph: statistics.median(r["window_ms_per_token"][ph] for r in rs)
                                    for ph in PHASES} if all(r["window_ms_per_token"] for r in rs) else None,
            "k_steps": {str(k): n for k, n in sorted(ks.items())},
            "window_k_steps": {str(k): n for k, n in sorted(window_ks.items())},
            "identical_to_plain": statistics.fmean(
                a == b for r, p in zip(rs, plain_runs) for a, b in zip(r["tokens"], p["tokens"]))}


def _batch_row(runs: dict[str, list[dict]], variants: dict, adaptive_name: str, repeats: int) -> dict:
    """Every variant's row at one batch size, and the adaptive policy against the best fixed one."""
    plain = summarize(runs["plain"], "tok_s")["median"]
    row = {name: _variant_row(rs, runs["plain"], plain) for name, rs in runs.items()}
    best_fixed = max((n for n in row if n != adaptive_name), key=lambda n: row[n]["tok_s"]["median"])
    row["adaptive_vs_best"] = row[adaptive_name]["tok_s"]["median"] / row[best_fixed]["tok_s"]["median"]
    # paired: each repeat's adaptive run over the same repeat's run of that best variant (the
    # two ran minutes apart, not a whole sweep apart), so slow drifts of the host cancel
    row["adaptive_vs_best_paired"] = summarize(
        [{"r": a["tok_s"] / f["tok_s"]} for a, f in zip(runs[adaptive_name], runs[best_fixed])], "r")
    row["best_fixed"] = best_fixed
    if repeats >= 2:
        row["adaptive_vs_best_held_out"] = summarize([{"r": x} for x in held_out_ratios(runs, adaptive_name)], "r")
    best_e2e = max(row[n]["tok_s_end_to_end"]["median"] for n in variants if n != adaptive_name)
    row["adaptive_vs_best_end_to_end"] = row[adaptive_name]["tok_s_end_to_end"]["median"] / best_e2e
    return row


def _print_row(b: int, row: dict, variants: dict, adaptive_name: str) -> None:
    held_out = f", held out {row['adaptive_vs_best_held_out']['median']:.3f}" \
        if "adaptive_vs_best_held_out" in row else ""
    print(f"batch {b:3d}: " + "  ".join(f"{n} {row[n]['tok_s']['median']:.0f}" for n in variants)
          + f"  tok/s; adaptive / best ({row['best_fixed']}) = {row['adaptive_vs_best']:.3f} "
          f"(paired median {row['adaptive_vs_best_paired']['median']:.3f}"
          + held_out + "); "
          f"(end to end {row['adaptive_vs_best_end_to_end']:.3f}); "
          f"adaptive K steps in the window {row[adaptive_name]['window_k_steps']} "
          f"(whole run {row[adaptive_name]['k_steps']})")


def _engine(args, pool: list[str]):
    """The engine every variant runs on, checked to prefill the largest batch in one step."""
    from engine import LLM

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
    return llm


def _runs(llm, pool: list[str], b: int, params, variants: dict, repeats: int) -> dict[str, list[dict]]:
    """Every variant's runs at batch b, interleaved, after a warm-up."""
    def variant(cfg):
        counter = itertools.count()  # interleave calls each variant once a repeat

        def go():
            llm.engine.reconfigure_speculation(**cfg)
            return run_batch(llm, repeat_prompts(pool, b, next(counter)), params)
        return go

    llm.engine.reconfigure_speculation(**PLAIN)
    run_batch(llm, pool[:b], params)  # warm-up
    runs = interleave({name: variant(cfg) for name, cfg in variants.items()}, repeats, f"batch {b}")
    if any(r["window_steps"] == 0 for rs in runs.values() for r in rs):
        print(f"batch {b}: a request finished before the window opened, so some runs report the whole run's "
              "tok/s (raise --tokens)")
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = parser("sweep", __doc__, tokens=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--method", choices=["draft", "eagle"], default="draft",
                    help="the model proposer (eagle: --draft defaults to the embedded EAGLE-3 head)")
    args = ap.parse_args(argv)
    if args.method == "eagle" and args.draft == "embedded:draft":
        args.draft = "embedded:eagle3"
    variants = method_variants(args.method)
    adaptive_name = f"{args.method} adaptive"
    torch.set_num_threads(args.threads)
    from engine import SamplingParams

    pool = load_prompts("code") + load_prompts("edit")
    llm = _engine(args, pool)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    results = {}
    for b in args.batches:
        runs = _runs(llm, pool, b, params, variants, args.repeats)
        results[str(b)] = row = _batch_row(runs, variants, adaptive_name, args.repeats)
        _print_row(b, row, variants, adaptive_name)
    payload = {"tokens": args.tokens, "repeats": args.repeats, "temperature": 0.0, "prefill_budget": PREFILL_BUDGET,
               "prompts_per_repeat": "next", "window": "after_catch_up", "variants": variants, "results": results}
    path = write("sweep" if args.method == "draft" else f"sweep_{args.method}", payload, llm)
    print(f"wrote {path}")


def _paired(row: dict, key: str = "adaptive_vs_best_paired") -> str:
    p = row[key]
    return f"{p['median']:.3f} ({p['min']:.2f}-{p['max']:.2f})"


def _table(r: dict, image: str = "sweep") -> list[str]:
    names = list(r["variants"])
    adaptive_name = next(n for n in names if n.endswith("adaptive"))
    windowed = "tok_s_end_to_end" in next(iter(r["results"].values()))[names[0]]
    paired = "adaptive_vs_best_paired" in next(iter(r["results"].values()))
    k_in_window = "window_k_steps" in next(iter(r["results"].values()))[adaptive_name]
    held_out = all("adaptive_vs_best_held_out" in row for row in r["results"].values())
    measure = ("decode tokens/s while all requests are in flight (prefill and drain left out; "
               "the last column is the whole run, both included)" if windowed else "tokens/s of the whole run")
    if r.get("window") == "after_catch_up":  # the first decode step (the proposer reading the prompts) left out
        measure += ("; every batch's prompts prefill in one step, and the first decode step, where the proposer "
                    "catches up on them, is left out for every variant (it is in the whole run)")
    elif "prefill_budget" in r:  # prefilled in one step: the proposer's catch-up on the prompts is in the window
        measure += ("; every batch's prompts prefill in one step, so the proposer's catch-up on them counts for "
                    "every variant")
    lines = [f"**Batch sweep** — concurrent requests submitted together, {r['tokens']} new tokens each, greedy, "
             f"medians of {r['repeats']} interleaved runs (`python -m bench sweep`); {tables.plan(r)}; {tables.host(r['machine'])}"
             f"; {measure}:", "",
             "| batch | " + " | ".join(names) + " | adaptive ÷ best other | K the adaptive policy used ("
             + ("steps in the window" if k_in_window else "steps") + ") |"
             + (" adaptive ÷ best, whole run |" if windowed else "") + (" adaptive ÷ best, paired |" if paired else "")
             + (" adaptive ÷ best, held out |" if held_out else ""),
             "| --- |" + " --- |" * (len(names) + 2 + windowed + paired + held_out)]
    for b, row in r["results"].items():
        counted = row[adaptive_name].get("window_k_steps", row[adaptive_name]["k_steps"])  # older runs: whole run
        ks = ", ".join(f"K={k}: {n}" for k, n in counted.items())
        lines.append(f"| {b} | " + " | ".join(f"{row[n]['tok_s']['median']:.0f}" for n in names)
                     + f" | {row['adaptive_vs_best']:.3f} ({row['best_fixed']}) | {ks} |"
                     + (f" {row['adaptive_vs_best_end_to_end']:.3f} |" if windowed else "")
                     + (f" {_paired(row)} |" if paired else "")
                     + (f" {_paired(row, 'adaptive_vs_best_held_out')} |" if held_out else ""))
    if paired:
        lines += ["", "The paired column is the median, over repeats, of each repeat's adaptive run ÷ the same "
                  "repeat's run of the best other variant (min-max in brackets): the two ran minutes apart, so "
                  "the host's slow drifts cancel, where the ratio of medians compares runs up to a sweep apart."]
    if r.get("prompts_per_repeat") == "next":
        lines += ["", "Each repeat of a batch size decodes the next prompts of the pool (wrapping), the same for "
                  "every variant of that repeat: the paired ratio compares runs on the same text, the ratio of "
                  "medians runs on different texts."]
    if held_out:
        lines += ["", "The held-out column pairs the same way, but picks the best other variant for each repeat "
                  "by its median over the other repeats: the best of several near-tied medians is the luckiest, "
                  "so picking and judging it on the same runs favours the fixed side."]
    return lines + [""] + tables.img(image)


def page_table() -> list[str]:
    """The results page's tables: the draft model's sweep, then the EAGLE-3 head's."""
    out = []
    for name in ("sweep", "sweep_eagle"):
        if (r := tables.load(name)) is not None:
            out += _table(r, image=name)
    return out


def page_targets(row: tables.Row) -> None:
    """The adaptive policy's target at every batch size, for each sweep run."""
    for name, what in (("sweep", "adaptive"), ("sweep_eagle", "adaptive with the EAGLE-3 head")):
        if (r := tables.load(name)) is None:
            continue
        ratios = {b: row_["adaptive_vs_best"] for b, row_ in r["results"].items()}
        worst = min(ratios, key=ratios.get)
        measured = f"{min(ratios.values()):.3f} (batch {worst}) to {max(ratios.values()):.3f}"
        if all("adaptive_vs_best_paired" in row_ for row_ in r["results"].values()):
            paired = {b: row_["adaptive_vs_best_paired"]["median"] for b, row_ in r["results"].items()}
            worst_paired = min(paired, key=paired.get)
            measured += (f" as ratios of medians; paired medians {min(paired.values()):.3f} (batch {worst_paired})"
                         f" to {max(paired.values()):.3f}")
        if all("adaptive_vs_best_held_out" in row_ for row_ in r["results"].values()):
            held = {b: row_["adaptive_vs_best_held_out"]["median"] for b, row_ in r["results"].items()}
            worst_held = min(held, key=held.get)
            measured += f"; held out {min(held.values()):.3f} (batch {worst_held}) to {max(held.values()):.3f}"
        row(f"{what} >= 0.97 x max(plain, best fixed K) at every batch size", measured, min(ratios.values()) >= 0.97)


if __name__ == "__main__":
    main()
