"""What row-count invariance costs (EngineConfig.batch_invariant, docs/speculative/exactness.md).

    python -m bench invariance [--tokens 64] [--repeats 5] [--prompts 8]
    python -m bench invariance --plain-only   # a plain-only engine's auto verdict against off, and a speculative engine's K = 0

Per method (EAGLE-3, hybrid), three engines of the shipped pair on this host's plan: invariance
on, off, and off again (the A/A pair), every run interleaved across them. Cases, end to end:
plain decoding in the speculative engine (its K = 0 steps) at batch 1 and 16, EAGLE-3 adaptive at
batch 1, hybrid adaptive at batch 16; greedy, `ignore_eos`. Figures: on ÷ off and off ÷ off-again,
the median over repeats of the per-repeat ratio of tokens/s, with its range.

--plain-only: engines with speculation off at start-up (`use_speculative_decoding: false`),
`batch_invariant` auto (the rule where its decode passes measured faster on it) and off twice,
beside a speculative engine's K = 0 steps (auto) and plain-only engines with the target's plan
forced (bf16, float32, float32 + the one-sequence kernel); plain decoding at batch 1, 16 and 64.
Figures: auto ÷ off, the A/A pair, the speculative engine's K = 0 ÷ the plain-only engine's auto
(what a plain user gets against the reference speculation is judged by), and auto ÷ the fastest
forced plan (does the plain-only engine's own plan pick plain's best?).
"""

from __future__ import annotations

import statistics

import torch

from bench.common import PLAIN, adaptive, host_class, interleave, parser, write
from bench.plans import run
from bench.workloads import load_prompts

CASES = {"plain, batch 1": ("eagle", PLAIN, 1), "plain, batch 16": ("eagle", PLAIN, 16),
         "EAGLE-3 adaptive, batch 1": ("eagle", adaptive("eagle"), 1),
         "hybrid adaptive, batch 16": ("hybrid", adaptive("hybrid"), 16)}
ENGINES = {"on": "on", "off": "off", "off (A/A)": "off"}  # variant -> batch_invariant


def engine(method: str, setting: str, max_batch_size: int = 16):
    from engine import LLM

    return LLM(speculative_method=method, batch_invariant=setting, max_batch_size=max_batch_size, max_seq_len=1024,
               enable_prefix_caching=False)


PLAIN_ONLY_ENGINES = {"auto": "auto", "off": "off", "off (A/A)": "off"}  # plain-only variant -> batch_invariant
PLAIN_ONLY_BATCHES = (1, 16, 64)
SPECULATIVE_K0 = "speculative engine, K = 0"
FORCED = {"forced bfloat16": {"dtype": "bfloat16"}, "forced float32": {"dtype": "float32"},
          "forced float32 + one-sequence kernel": {"dtype": "float32", "one_sequence_kernel": True}}  # target plans


def ratios(runs: dict, a: str, b: str) -> dict:
    r = [x["tok_s"] / y["tok_s"] for x, y in zip(runs[a], runs[b])]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "n": len(r)}


def main(argv: list[str] | None = None) -> None:
    ap = parser("invariance", __doc__, tokens=64, models=False)
    ap.add_argument("--prompts", type=int, default=8, help="code prompts at batch 1 (twice as many at batch 16)")
    ap.add_argument("--plain-only", action="store_true", help="a plain-only engine's auto verdict instead")
    ap.set_defaults(repeats=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.plain_only:
        return plain_only(args)
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llms = {(m, v): engine(m, s) for m in ("eagle", "hybrid") for v, s in ENGINES.items()}
    states = {f"{m} {v}": llm.engine.stats()["batch_invariant"] for (m, v), llm in llms.items()}
    results = {}
    for case, (method, spec, batch) in CASES.items():
        prompts = load_prompts("code", args.prompts * (2 if batch > 1 else 1))
        variants = {v: run(llms[method, v], spec, prompts, params, batch) for v in ENGINES}
        runs = interleave(variants, args.repeats, case)
        results[case] = {"on / off": ratios(runs, "on", "off"), "A/A": ratios(runs, "off", "off (A/A)"), "runs": runs}
    from engine.model.plan import label

    host, plan = host_class(), label(llms["eagle", "on"].engine.forward_plan["target"])
    lines = [f"Host: {host}, {args.threads} threads; the target's plan {plan}; {args.tokens} tokens, "
             f"{args.repeats} repeats",
             "", "| case | on ÷ off (median, range) | A/A |", "| --- | --- | --- |"]
    for case, r in results.items():
        on, aa = r["on / off"], r["A/A"]
        lines.append(f"| {case} | {on['median']:.3f} ({on['min']:.3f}-{on['max']:.3f}) | {aa['median']:.3f} |")
    print("\n".join(lines))
    path = write("invariance_cost", {"host": host, "batch_invariant": states, "tokens": args.tokens,
                                     "repeats": args.repeats, "results": results}, llms["eagle", "on"])
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def plain_only(args) -> None:
    """--plain-only: plain decoding at PLAIN_ONLY_BATCHES on plain-only engines (auto, off, off
    again) and a speculative engine's K = 0 steps, interleaved."""
    from engine import LLM, SamplingParams
    from engine.model.plan import label

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    widest = max(PLAIN_ONLY_BATCHES)
    llms = {v: LLM(use_speculative_decoding=False, batch_invariant=s, max_batch_size=widest, max_seq_len=1024,
                   enable_prefix_caching=False) for v, s in PLAIN_ONLY_ENGINES.items()}
    llms[SPECULATIVE_K0] = engine("eagle", "auto", widest)
    for name, plan in FORCED.items():  # what a plain user could force instead (batch_invariant auto in each)
        try:
            llms[name] = LLM(use_speculative_decoding=False, forward_plan={"target": plan}, max_batch_size=widest,
                             max_seq_len=1024, enable_prefix_caching=False)
        except ValueError as e:  # a plan this host cannot run (bf16 without its kernels)
            print(f"{name}: not run here ({e})")
    states = {v: llm.engine.stats()["batch_invariant"] for v, llm in llms.items()}
    results = {}
    for batch in PLAIN_ONLY_BATCHES:
        wanted = args.prompts if batch == 1 else max(2 * args.prompts, batch)
        prompts = (load_prompts("code") * wanted)[:wanted]
        runs = interleave({v: run(llm, PLAIN, prompts, params, batch) for v, llm in llms.items()}, args.repeats,
                          f"plain, batch {batch}")
        results[f"plain, batch {batch}"] = {"auto / off": ratios(runs, "auto", "off"),
                                            "A/A": ratios(runs, "off", "off (A/A)"),
                                            "K = 0 / auto": ratios(runs, SPECULATIVE_K0, "auto"), "runs": runs}
        forced = [n for n in FORCED if n in runs]
        best = max(forced, key=lambda n: statistics.median(r["tok_s"] for r in runs[n]))
        results[f"plain, batch {batch}"].update({"best forced": best, "auto / best forced": ratios(runs, "auto", best)})
    host, plan = host_class(), label(llms["auto"].engine.forward_plan["target"])
    lines = [f"Host: {host}, {args.threads} threads; a plain-only engine's plan {plan}, batch_invariant auto: "
             f"{states['auto']}; {args.tokens} tokens, {args.repeats} repeats", "",
             "| case | auto ÷ off | A/A | speculative engine's K = 0 ÷ plain-only auto | auto ÷ the best forced plan |",
             "| --- | --- | --- | --- | --- |"]
    for case, r in results.items():
        cells = [r[k] for k in ("auto / off", "A/A", "K = 0 / auto", "auto / best forced")]
        lines.append(f"| {case} | " + " | ".join(f"{c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f})" for c in cells)
                     + f" ({r['best forced']}) |")
    print("\n".join(lines))
    path = write("invariance_plain_only", {"host": host, "batch_invariant": states, "tokens": args.tokens,
                                           "repeats": args.repeats, "results": results}, llms["auto"])
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
