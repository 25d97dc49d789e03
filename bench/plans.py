"""The forward plan the engine measures at load (`forward_plan: auto`) against every plan forced.

    python -m bench plan [--workload code] [--prompts 4] [--tokens 64] [--repeats 3] [--batches 1 16]

Engines on the shipped pair: one with the auto plan, one per candidate plan of the target (with
the draft's auto choice) and one per candidate plan of the draft (with the target's auto choice).
Each runs plain decoding, draft K = 5 and hybrid adaptive at each batch size (batch 1: the prompts
one at a time; batch B: B prompts submitted together), greedy, all interleaved and repeated. The
report gives, per setting and batch, the auto plan's tokens/s over the best forced plan's (median
of per-repeat ratios, so the host's slow drifts cancel) and every forced plan's tokens/s.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from bench.common import (
    PLAIN,
    adaptive,
    batch1_llm,
    fixed,
    host_class,
    interleave,
    parser,
    plan_summary,
    summarize,
    write,
)
from bench.workloads import load_prompts

SETTINGS = {"plain": PLAIN, "draft K=5": fixed("draft", 5), "hybrid adaptive": adaptive("hybrid")}


def forced_plans(auto: dict) -> dict[str, dict]:
    """label -> forward_plan: each target candidate with the auto draft, each draft candidate with
    the auto target."""
    from engine.config import ModelPlan
    from engine.model.plan import candidates, label

    fields = [f.name for f in dataclasses.fields(ModelPlan)]
    chosen = {role: ModelPlan(**{k: auto[role][k] for k in fields}) for role in ("target", "draft")}
    plans = {}
    for role in ("target", "draft"):
        for option in candidates(role, "bfloat16", "cpu"):
            pair = {**chosen, role: option}
            plans[f"target {label(pair['target'])}, draft {label(pair['draft'])}"] = \
                {r: dataclasses.asdict(p) for r, p in pair.items()}
    return plans


def run(llm, spec: dict, prompts: list, params, batch: int):
    def go() -> dict:
        llm.engine.reconfigure_speculation(**spec)
        t0 = time.perf_counter()
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        tokens = sum(len(o.token_ids) for g in groups for o in llm.generate(g, params))
        return {"tok_s": tokens / (time.perf_counter() - t0)}
    return go


def main(argv: list[str] | None = None) -> None:
    ap = parser("plan", __doc__, tokens=64)
    ap.add_argument("--workload", choices=["code", "edit"], default="code")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per batch-1 run")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import SamplingParams

    auto = batch1_llm(args.target, args.draft, "auto", max(args.batches))
    plans = forced_plans(auto.engine.forward_plan)
    llms = {"auto": auto, **{name: batch1_llm(args.target, args.draft, p, max(args.batches)) for name, p in plans.items()}}
    texts = load_prompts("code") + load_prompts("edit")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    variants = {}
    for batch in args.batches:
        prompts = [auto.engine.tokenizer.encode(p) for p in (load_prompts(args.workload, args.prompts) if batch == 1
                                                             else texts[:batch])]
        for setting, spec in SETTINGS.items():
            for name, llm in llms.items():
                variants[(batch, setting, name)] = run(llm, spec, prompts, params, batch)
    for fn in variants.values():  # warm-up: kernels, the adaptive policy's first measurements
        fn()
    runs = interleave({" | ".join(map(str, k)): v for k, v in variants.items()}, args.repeats, "forward plans")
    results = summarize_runs(runs, args.batches, list(llms))
    path = write("plans", {"workload": args.workload, "prompts": args.prompts, "tokens": args.tokens,
                           "repeats": args.repeats, "host": host_class(), "auto_plan": plan_summary(auto.engine.forward_plan),
                           "forced_plans": plans, "results": results}, auto)
    print(f"wrote {path}")


def summarize_runs(runs: dict, batches: list[int], engines: list[str]) -> dict:
    results = {}
    for batch in batches:
        for setting in SETTINGS:
            rs = {name: runs[f"{batch} | {setting} | {name}"] for name in engines}
            forced = [n for n in engines if n != "auto"]
            best = max(forced, key=lambda n: statistics.median(r["tok_s"] for r in rs[n]))
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(rs["auto"], rs[best])]
            entry = {"tok_s": {n: summarize(rs[n], "tok_s") for n in engines}, "best_forced": best,
                     "auto_over_best": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
            results[f"batch {batch}, {setting}"] = entry
            print(f"batch {batch:2d} {setting:16s} auto {entry['tok_s']['auto']['median']:7.1f} tok/s; best forced "
                  f"{entry['tok_s'][best]['median']:7.1f} ({best}); auto/best {entry['auto_over_best']['median']:.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f})")
    return results


if __name__ == "__main__":
    main()
