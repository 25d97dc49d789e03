"""Token trees vs chains: accepted tokens per round and speed, on the shipped target.

    python -m bench trees [--method ngram] [--workload code] [--prompts 8] [--tokens 96] [--repeats 3]
                          [--batches 8 16 32 64] [--skip-batch-1]
    (--method other than ngram -> bench/results/trees_<method>.json; --skip-batch-1 -> ..._batches.json)

Batch 1, greedy and T = 0.8, held-out prompts one at a time, each decoded by every variant back to
back (bench.common.interleave_prompts; the seeds differ from repeat to repeat): a chain and a tree of the
same depth at fixed K (accepted tokens per round, tree ÷ chain), and adaptive K with and without
trees (tok/s, trees ÷ chain-only; plain decoding beside them). Then batches of the same prompts
(repeated to fill): adaptive with trees ÷ adaptive chain-only (trees must never cost). At batch 1 and
in the batches the chain-only variant runs twice per repeat (at batches one each side of the tree
variant, as `interleave` alternates the order): trees are set against the mean of the two, and the
second chain against the first (an A/A ratio: how far two identical variants differ on this host,
the floor the tree ratio is read against).

Beside the fixed-K tree ÷ chain speed, a ceiling: the speed a tree round would reach if its drafting
and host bookkeeping cost what the chain's do, only its target phase (the verify pass of its width,
the acceptance) being its own. Where the ceiling is below 1.0 no cheaper tree drafting lets that tree
beat the chain of its depth on this host: its verify costs more than its extra tokens bring.
"""

from __future__ import annotations

import math
import statistics

import torch

from bench.common import (
    PLAIN,
    SeparateLearning,
    adaptive,
    fixed,
    interleave,
    interleave_prompts,
    parser,
    pooled,
    write,
)
from bench.sweep import run_batch
from bench.workloads import load_prompts

AGAIN = "adaptive chain, again"  # the chain-only variant's second run in each repeat (A/A)


def _parser():
    ap = parser("trees", __doc__, tokens=96, models=False)
    ap.add_argument("--workload", choices=["code", "edit"], default="code")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--k", type=int, default=4, help="depth of the fixed-K chain and tree")
    ap.add_argument("--width", type=int, default=3, help="tree_width of the tree variants")
    ap.add_argument("--nodes", type=int, default=12, help="tree_tokens of the tree variants")
    ap.add_argument("--batches", type=int, nargs="*", default=[8, 16, 32, 64])
    ap.add_argument("--skip-batch-1", action="store_true", help="only the batches (results: ..._batches.json)")
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix", "eagle", "draft", "hybrid"],
                    help="the proposer (eagle and hybrid: the embedded EAGLE-3 head; draft: the embedded draft)")
    return ap


def tree_shapes(method: str, k: int, width: int) -> dict[str, dict]:
    """The variants' reconfigure_speculation() settings: plain, a chain and a tree at fixed K, and
    adaptive K with chains only (twice: the A/A twin) and with trees."""
    chain, tree = {"tree_width": 1}, {"tree_width": width}
    return {"plain": PLAIN, f"chain K={k}": {**fixed(method, k), **chain},
            f"tree K={k}": {**fixed(method, k), **tree},
            "adaptive chain": {**adaptive(method), **chain}, "adaptive tree": {**adaptive(method), **tree},
            AGAIN: {**adaptive(method), **chain}}


def batch1_runs(llm, shapes: dict, prompts: list, args, temperature: float, learning) -> dict[str, list[dict]]:
    """Every variant on the prompts one at a time at `temperature`: one warm-up repeat (the adaptive
    calibration too), then args.repeats measured ones, each repeat on its own seeds."""
    from engine import SamplingParams

    def params(r: int) -> list:  # repeat r's seeds, the same for every variant
        return [SamplingParams(temperature=temperature, max_tokens=args.tokens, ignore_eos=True, seed=1000 * r + i)
                for i in range(len(prompts))]

    interleave_prompts(llm, shapes, prompts, params, 1, f"warm-up, T={temperature}",
                       learning=learning)  # the adaptive calibration too
    return interleave_prompts(llm, shapes, prompts, lambda r: params(r + 1), args.repeats,
                              f"batch 1, T={temperature}", learning=learning)


def batch1_row(llm, runs: dict[str, list[dict]], k: int) -> dict:
    """Batch 1's results: each variant's medians, tree ÷ chain at fixed K (accepted per round,
    tok/s, the drafting-free ceiling), adaptive trees ÷ chains with the A/A floor, and the theory."""
    row = {name: {key: statistics.median(r[key] for r in runs[name])
                  for key in ("tok_s", "accepted_per_round", "verified_per_round")} for name in runs}
    same_depth = [t["accepted_per_round"] / c["accepted_per_round"]
                  for t, c in zip(runs[f"tree K={k}"], runs[f"chain K={k}"]) if c["accepted_per_round"]]
    row["tree_over_chain_accepted_per_round"] = {"median": statistics.median(same_depth), "min": min(same_depth),
                                                 "max": max(same_depth)}
    fixed_runs = runs[f"tree K={k}"], runs[f"chain K={k}"]
    fixed_tree, fixed_chain = map(_summed, fixed_runs)
    row["fixed_tree_over_chain_tok_s"] = _spread([t["tok_s"] / c["tok_s"] for t, c in zip(*fixed_runs)],
                                                 fixed_tree["tok_s"] / fixed_chain["tok_s"])
    row["drafting_free_ceiling"] = _spread([drafting_free_ceiling(t, c) for t, c in zip(*fixed_runs)],
                                           drafting_free_ceiling(fixed_tree, fixed_chain))
    adaptive_names = ("adaptive tree", "adaptive chain", AGAIN)
    row.update(_trees_against_chains(*([r["tok_s"] for r in runs[name]] for name in adaptive_names),
                                     *(pooled(runs[name], "tokens", "seconds") for name in adaptive_names)))
    row["theoretical"] = {name: theoretical_speedup(llm, row[name], row["plain"], k)
                          for name in (f"chain K={k}", f"tree K={k}")}
    return row


def print_batch1(temperature: float, row: dict, k: int) -> None:
    """Batch 1's results at one temperature, three lines."""
    same_depth = row["tree_over_chain_accepted_per_round"]
    print(f"T={temperature}: accepted/round chain {row[f'chain K={k}']['accepted_per_round']:.3f} "
          f"tree {row[f'tree K={k}']['accepted_per_round']:.3f} -> x{same_depth['median']:.3f} "
          f"[{same_depth['min']:.3f}, {same_depth['max']:.3f}]; adaptive tok/s tree/chain "
          f"{_said(row['adaptive_tree_over_chain_tok_s'])}; "
          f"A/A chain/chain {_said(row['a_a_chain_over_chain_tok_s'])}; plain {row['plain']['tok_s']:.1f} tok/s",
          flush=True)
    print(f"  fixed K={k} tok/s tree/chain {_said(row['fixed_tree_over_chain_tok_s'])}; the same with the "
          f"tree drafting at the chain's cost (ceiling) {_said(row['drafting_free_ceiling'])}", flush=True)
    print("  measured / theoretical speedup: " + "; ".join(
        f"{n} {t['measured']:.2f} / {t['theoretical']:.2f} = {t['measured_over_theoretical']:.3f}"
        for n, t in row["theoretical"].items()), flush=True)


def batch_row(llm, shapes: dict, prompts: list, b: int, args, learning) -> dict:
    """Batch b (the prompts repeated to fill it), greedy: adaptive trees ÷ chains and the A/A floor,
    end-to-end tok/s, each variant warmed up once first."""
    from engine import SamplingParams

    batch = (prompts * (b // len(prompts) + 1))[:b]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def batch_variant(name: str):
        def go() -> dict:
            llm.engine.reconfigure_speculation(**shapes["adaptive chain" if name == AGAIN else name])
            learning.switch_to(f"{name}, batch {len(batch)}")
            run = run_batch(llm, batch, params)
            del run["tokens"]
            return run
        return go

    variants = {name: batch_variant(name) for name in ("adaptive chain", "adaptive tree", AGAIN)}
    for fn in variants.values():
        fn()
    runs = interleave(variants, args.repeats, f"batch {b}")
    tok_s = [[r["tok_s_end_to_end"] for r in runs[name]] for name in ("adaptive tree", "adaptive chain", AGAIN)]
    row = _trees_against_chains(*tok_s, *map(sum, tok_s))
    print(f"batch {b}: adaptive tree/chain tok/s {_said(row['adaptive_tree_over_chain_tok_s'])}; "
          f"A/A chain/chain {_said(row['a_a_chain_over_chain_tok_s'])}", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import LLM

    prompts = load_prompts(args.workload)[:args.prompts]
    model = {"draft_model": "embedded:draft"} if args.method == "draft" else {}
    llm = LLM(speculative_method=args.method, max_batch_size=max([1, *args.batches]), max_seq_len=1024,
              enable_prefix_caching=False, tree_tokens=args.nodes, **model)
    method = args.method
    shapes = tree_shapes(method, args.k, args.width)
    results: dict = {"batch_1": {}, "batches": {}}
    learning = SeparateLearning(llm)  # each variant learns its own costs and shapes, as if it ran alone
    for temperature in () if args.skip_batch_1 else (0.0, 0.8):
        row = batch1_row(llm, batch1_runs(llm, shapes, prompts, args, temperature, learning), args.k)
        print_batch1(temperature, row, args.k)
        results["batch_1"][f"T={temperature}"] = row
    for b in args.batches:
        results["batches"][str(b)] = batch_row(llm, shapes, prompts, b, args, learning)
    name = ("trees" if method == "ngram" else f"trees_{method}") + ("_batches" if args.skip_batch_1 else "")
    path = write(name, {"method": method, "workload": args.workload, "prompts": args.prompts, "tokens": args.tokens, "k": args.k,
                           "width": args.width, "nodes": args.nodes, "repeats": args.repeats, "results": results}, llm)
    print(f"wrote {path}")


def _trees_against_chains(tree: list[float], chain: list[float], again: list[float], pooled_tree: float,
                          pooled_chain: float, pooled_again: float) -> dict:
    """From each repeat's tok/s (and pooled figures) of the tree variant and the chain-only variant's
    two runs: trees ÷ the mean of the two runs, and the second run ÷ the first (the A/A floor)."""
    chains = [(c + a) / 2 for c, a in zip(chain, again)]
    return {"adaptive_tree_over_chain_tok_s": _spread([t / c for t, c in zip(tree, chains)],
                                                      pooled_tree / ((pooled_chain + pooled_again) / 2)),
            "a_a_chain_over_chain_tok_s": _spread([a / c for a, c in zip(again, chain)], pooled_again / pooled_chain)}


def _spread(ratios: list[float], pooled_ratio: float) -> dict:
    """A ratio's median, range and pooled value, with every repeat's (so later runs can be pooled with it)."""
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "pooled": pooled_ratio,
            "repeats": ratios}


def _said(r: dict) -> str:
    return f"x{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}] (pooled x{r['pooled']:.3f})"


def drafting_free_ceiling(tree: dict, chain: dict) -> float:
    """Tree ÷ chain tok/s (interleave_prompts runs of one repeat, the same tokens) were the tree's
    rounds to cost the chain's drafting and other seconds per round, only their target phase
    (verify and acceptance) their own: the chain's seconds with its rounds' target seconds
    replaced by the tree's, and its per-round drafting and bookkeeping taken as many times as the
    tree has rounds."""
    c, t = chain["phases"], tree["phases"]
    per_round = (c["draft"] + c["other"]) / chain["rounds"] if chain["rounds"] else 0.0  # no rounds: a lookup found nothing
    seconds = chain["seconds"] + t["target"] - c["target"] + (tree["rounds"] - chain["rounds"]) * per_round
    return (tree["tokens"] / seconds) / chain["tok_s"]


def _summed(runs: list[dict]) -> dict:
    """The repeats of one variant as one run (for pooled ratios)."""
    phases = {p: sum(r["phases"][p] for r in runs) for p in runs[0]["phases"]}
    total = {key: sum(r[key] for r in runs) for key in ("tokens", "seconds", "rounds")}
    return {**total, "phases": phases, "tok_s": total["tokens"] / total["seconds"]}


def theoretical_speedup(llm, shape: dict, plain: dict, k: int) -> dict:
    """Leviathan et al.'s speedup with the engine's measured costs at batch 1: (accepted per round
    + 1) x a plain pass's time ÷ (the verify pass of the round's mean width + a model proposer's
    drafting of a K = k chain; a tree's drafting, dearer, is priced as that chain's), beside the
    measured speedup (tok/s ÷ plain's) and their ratio (what the engine's own work costs)."""
    costs = llm.engine.speculation.costs
    nodes = shape["verified_per_round"]
    times = costs.verify_times(1, max(1, math.ceil(nodes)))
    low = int(nodes)
    verify = times[low] + (nodes - low) * (times[min(low + 1, len(times) - 1)] - times[low])
    draft = 0.0
    if llm.engine.speculation.proposer.runs_model:
        first, steps = costs.draft_times(1, k)
        draft = first[0] + steps[k - 1]
    theory = (shape["accepted_per_round"] + 1) * times[0] / (verify + draft)
    measured = shape["tok_s"] / plain["tok_s"]
    return {"theoretical": theory, "measured": measured, "measured_over_theoretical": measured / theory}


if __name__ == "__main__":
    main()
