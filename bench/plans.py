"""The forward plan the engine measures at load (`forward_plan: auto`) against the other plans.

    python -m bench plan [--workload code] [--prompts 8] [--tokens 96] [--repeats 7] [--batches 1 16]

One engine per distinct plan of the shipped pair: each candidate plan of the target with the
draft's auto choice, and each candidate plan of the draft with the target's auto choice (the
auto plan is one of them). Each runs plain decoding, draft K = 5 and hybrid adaptive at each
batch size (batch 1: the prompts one at a time; batch B: B prompts submitted together), greedy,
all interleaved and repeated. Per setting, auto is compared with the best of the engines whose
plan changes that setting's passes (for plain decoding only the target's plan does): the median
over repeats of auto's tokens/s over that engine's in the same repeat.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from bench import tables
from bench.common import (
    PLAIN,
    adaptive,
    batch1_llm,
    fixed,
    host_class,
    interleave,
    parser,
    summarize,
    write,
)
from bench.workloads import load_prompts

SETTINGS = {"plain": PLAIN, "draft K=5": fixed("draft", 5), "hybrid adaptive": adaptive("hybrid")}


def plans_around(auto: dict, shapes: dict) -> tuple[str, dict[str, dict]]:
    """(the auto plan's label, label -> forward_plan for it and every one-model change of it);
    shapes: role -> ModelShape."""
    from engine.config import ModelPlan
    from engine.model.plan import candidates, label

    fields = [f.name for f in dataclasses.fields(ModelPlan)]
    chosen = {role: ModelPlan(**{k: auto[role][k] for k in fields}) for role in ("target", "draft")}
    name = lambda pair: f"target {label(pair['target'])}, draft {label(pair['draft'])}"  # noqa: E731
    plans = {}
    for role in ("target", "draft"):
        for option in candidates(role, "bfloat16", "cpu", shapes[role]):
            pair = {**chosen, role: option}
            plans[name(pair)] = {r: dataclasses.asdict(p) for r, p in pair.items()}
    return name(chosen), plans


def run(llm, spec: dict, prompts: list, params, batch: int):
    def go() -> dict:
        llm.engine.reconfigure_speculation(**spec)
        t0 = time.perf_counter()
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        tokens = sum(len(o.token_ids) for g in groups for o in llm.generate(g, params))
        return {"tok_s": tokens / (time.perf_counter() - t0)}
    return go


def main(argv: list[str] | None = None) -> None:
    ap = parser("plan", __doc__, tokens=96)
    ap.add_argument("--workload", choices=["code", "edit"], default="code")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch-1 run")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.set_defaults(repeats=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import SamplingParams
    from engine.model.plan import summary

    probe = batch1_llm(args.target, args.draft, "auto", max(args.batches))  # measures (or reads) the plan
    auto, plans = plans_around(probe.engine.forward_plan,
                               {"target": probe.engine.model.shape, "draft": probe.engine.draft_model.shape})
    del probe
    llms = {name: batch1_llm(args.target, args.draft, p, max(args.batches)) for name, p in plans.items()}
    texts = load_prompts("code") + load_prompts("edit")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    variants = {}
    for batch in args.batches:
        ids = [llms[auto].engine.tokenizer.encode(p)
               for p in (load_prompts(args.workload, args.prompts) if batch == 1 else texts[:batch])]
        for setting, spec in SETTINGS.items():
            for name, llm in llms.items():
                variants[f"{batch} | {setting} | {name}"] = run(llm, spec, ids, params, batch)
    for fn in variants.values():  # warm-up: kernels, the adaptive policy's first measurements
        fn()
    runs = interleave(variants, args.repeats, "forward plans")
    results = summarize_runs(runs, args.batches, auto, plans)
    path = write("plans", {"workload": args.workload, "prompts": args.prompts, "tokens": args.tokens,
                           "repeats": args.repeats, "host": host_class(), "auto": auto,
                           "auto_plan": summary(llms[auto].engine.forward_plan), "plans": plans,
                           "results": results}, llms[auto])
    print(f"wrote {path}")


def summarize_runs(runs: dict, batches: list[int], auto: str, plans: dict[str, dict]) -> dict:
    results = {}
    for batch in batches:
        for setting in SETTINGS:
            rs = {name: runs[f"{batch} | {setting} | {name}"] for name in plans}
            # plain decoding runs the target alone: only plans that change the target's count
            rivals = [n for n in plans if n != auto and (setting != "plain" or plans[n]["target"] != plans[auto]["target"])]
            best = max(rivals, key=lambda n: statistics.median(r["tok_s"] for r in rs[n]))
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(rs[auto], rs[best])]
            entry = {"tok_s": {n: summarize(rs[n], "tok_s") for n in plans}, "best_other": best,
                     "auto_over_best_other": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
            results[f"batch {batch}, {setting}"] = entry
            print(f"batch {batch:2d} {setting:16s} auto {entry['tok_s'][auto]['median']:7.1f} tok/s; best other "
                  f"{entry['tok_s'][best]['median']:7.1f} ({best}); auto/best other {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f})")
    return results


def draw(r: dict) -> list[str]:
    m, res, auto = r["machine"], r["results"], r["auto"]
    lines = [f"**Forward plan: measured (auto) vs the others** — workload `{r['workload']}`, greedy, {r['tokens']} new "
             f"tokens, batch 1 ({r['prompts']} prompts one at a time) and 16, medians of {r['repeats']} interleaved "
             f"runs, {tables.host(m)}, {m['threads']} threads (`python -m bench plan`); auto: {auto}. One engine per plan: "
             "auto's, and each change of one model's plan from it; auto is compared with the best engine whose plan "
             "changes the setting's passes (plain decoding: only the target's):", "",
             "| setting | auto tok/s | best other plan | its tok/s | auto ÷ best other (median of per-run ratios, range) |",
             "| --- | --- | --- | --- | --- |"]
    for setting, e in res.items():
        best, ratio = e["best_other"], e["auto_over_best_other"]
        lines.append(f"| {setting} | {e['tok_s'][auto]['median']:.0f} | {best} | {e['tok_s'][best]['median']:.0f} | "
                     f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f}) |")
    names = list(next(iter(res.values()))["tok_s"])
    lines += ["", "Every engine, tok/s:", "", "| plan | " + " | ".join(res) + " |", "| --- |" + " --- |" * len(res)]
    lines += [f"| {n}{' (auto)' if n == auto else ''} | " + " | ".join(f"{e['tok_s'][n]['median']:.0f}" for e in res.values())
              + " |" for n in names]
    return lines + [""]



def page_targets(row: tables.Row) -> None:
    """The forward plan's target: auto within 5% of the best other."""
    if (r := tables.load("plans")) is not None:
        ratios = {k: e["auto_over_best_other"]["median"] for k, e in r["results"].items()}
        worst = min(ratios, key=ratios.get)
        row("forward plan: auto within 5% of the best other plan (plain, draft K=5, hybrid adaptive; batch 1 and 16)",
            f"{min(ratios.values()):.3f} ({worst}) to {max(ratios.values()):.3f}", min(ratios.values()) >= 0.95)


if __name__ == "__main__":
    main()
