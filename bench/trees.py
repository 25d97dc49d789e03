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

from bench import tables
from bench.batch_run import run_batch
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


TREE_RESULTS = ("trees", "trees_eagle", "trees_eagle_8nodes", "trees_draft")  # bench trees runs, by method and size


def _tree_runs() -> list[dict]:
    """The bench trees runs; a later `--skip-batch-1` run (<name>_batches.json) replaces its
    run's batches."""
    runs = []
    for name in TREE_RESULTS:
        if (r := tables.load(name)) is None:
            continue
        if (later := tables.load(f"{name}_batches")) is not None and later["results"].get("batches"):
            r = {**r, "results": {**r["results"], "batches": later["results"]["batches"]},
                 "batches_machine": later["machine"]}
        runs.append(r)
    return runs


def _table(runs: list[dict]) -> list[str]:
    """Token trees vs chains at batch 1, one row per run and temperature; then the batch runs."""
    first = runs[0]
    lines = [f"**Token trees vs chains** — the shipped target, {first['workload']} prompts one at a time (batch 1), "
             f"K = {first['k']}, medians over repeats (each its own seeds) with their range; {tables.host(first['machine'])} "
             "(`python -m bench trees --method M --width W --nodes N`). *Accepted/round*: tokens accepted per "
             "verify round at fixed K, chain and tree of the same depth. *Adaptive*: tok/s with trees allowed ÷ "
             "chains only, both under the adaptive policy (goal: at least 1.0; against the mean of the chain-only "
             "variant's two runs where it ran twice). *A/A*: the chain-only variant's second run ÷ its first, how far "
             "two identical variants differ here. *Fixed K, tok/s*: the tree ÷ the chain of its depth, then the same "
             "were the tree's drafting and host bookkeeping to cost the chain's (its verify pass and acceptance its "
             "own): below 1.0, no cheaper drafting lets that tree beat the chain here. *÷ theory*: measured speedup over "
             "plain ÷ Leviathan et al.'s with the measured costs.", "",
             "| method | nodes, width | prompts x tokens | T | accepted/round chain → tree | tree ÷ chain | "
             "adaptive trees ÷ chains, tok/s | A/A chains ÷ chains | fixed K, tok/s: tree ÷ chain; drafting free | "
             "÷ theory chain / tree |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        for temp, row in r["results"].get("batch_1", {}).items():
            k = r["k"]
            chain, tree = row[f"chain K={k}"], row[f"tree K={k}"]
            theory = row["theoretical"]
            lines.append(f"| {r['method']} | {r['nodes']}, {r['width']} | {r['prompts']} x {r['tokens']} | "
                         f"{temp.removeprefix('T=')} | {chain['accepted_per_round']:.2f} → {tree['accepted_per_round']:.2f} | "
                         f"{tables.spread(row['tree_over_chain_accepted_per_round'])} | "
                         f"{tables.spread(row['adaptive_tree_over_chain_tok_s'])} | "
                         f"{tables.spread(row['a_a_chain_over_chain_tok_s']) if 'a_a_chain_over_chain_tok_s' in row else '—'} | "
                         f"{_fixed_and_ceiling(row)} | "
                         f"{theory[f'chain K={k}']['measured_over_theoretical']:.2f} / "
                         f"{theory[f'tree K={k}']['measured_over_theoretical']:.2f} |")
    batches = [r for r in runs if r["results"].get("batches")]
    for r in batches:
        lines += ["", f"Batches of the same prompts (repeated to fill), greedy, {r['method']} trees of up to {r['nodes']} "
                  f"nodes, width {r['width']}; adaptive with trees ÷ adaptive chains only, tok/s (goal: at least 0.97), "
                  f"{tables.host(r.get('batches_machine', r['machine']))}: " + ", ".join(
                      f"batch {b} {tables.spread(row['adaptive_tree_over_chain_tok_s'])}" for b, row in r["results"]["batches"].items())]
        a_a = {b: row["a_a_chain_over_chain_tok_s"] for b, row in r["results"]["batches"].items() if "a_a_chain_over_chain_tok_s" in row}
        if a_a:  # the chain-only variant run twice a repeat: how far two identical variants differ here
            lines[-1] += ("; two runs of the chain-only variant against each other (A/A): "
                          + ", ".join(f"batch {b} {tables.spread(x)}" for b, x in a_a.items()))
    return lines + [""]


def _fixed_and_ceiling(row: dict) -> str:
    """A batch-1 row's fixed-K tree ÷ chain tok/s and its drafting-free ceiling ("—" for runs without)."""
    if "drafting_free_ceiling" not in row:
        return "—"
    return f"{tables.spread(row['fixed_tree_over_chain_tok_s'])}; {tables.spread(row['drafting_free_ceiling'])}"


def page_table() -> list[str]:
    """The results page's table (bench/tables.py): every trees run's."""
    return _table(runs) if (runs := _tree_runs()) else []


def page_targets(row: tables.Row) -> None:
    """The token-tree targets: accepted tokens per round, and tok/s at batch 1 and in batches."""
    tree_runs = _tree_runs()
    labels = [f"{r['method']} {r['nodes']} nodes" for r in tree_runs]
    gains = {label: row_["tree_over_chain_accepted_per_round"]["median"] for label, r in zip(labels, tree_runs)
             if (row_ := r["results"].get("batch_1", {}).get("T=0.0"))}
    speed = {f"{label} {t}": row_["adaptive_tree_over_chain_tok_s"]["median"] for label, r in zip(labels, tree_runs)
             for t, row_ in r["results"].get("batch_1", {}).items()}
    batches = {f"{label} batch {b}": row_["adaptive_tree_over_chain_tok_s"]["median"] for label, r in zip(labels, tree_runs)
               for b, row_ in r["results"].get("batches", {}).items()}

    def beside(rows: list[dict]) -> str:  # the A/A medians and the ceilings beside a ratio's span, where the runs have them
        a_a = [x["a_a_chain_over_chain_tok_s"]["median"] for x in rows if "a_a_chain_over_chain_tok_s" in x]
        ceilings = [x["drafting_free_ceiling"]["median"] for x in rows if "drafting_free_ceiling" in x]
        return (f"; A/A {min(a_a):.3f} to {max(a_a):.3f}" if a_a else "") + (
            f"; fixed-K trees with chain-cost drafting {min(ceilings):.3f} to {max(ceilings):.3f}" if ceilings else "")

    batch_1_rows = [x for r in tree_runs for x in r["results"].get("batch_1", {}).values()]
    batch_rows = [x for r in tree_runs for x in r["results"].get("batches", {}).values()]
    for values, target, met, rows_ in (
            (gains, "token trees: accepted tokens per round >= 1.15x the chain's of the same depth (batch 1, greedy, "
             "code)", lambda v: max(v) >= 1.15, []),
            (speed, "token trees: adaptive with trees >= 1.0x adaptive chains only, tok/s (batch 1)",
             lambda v: min(v) >= 1.0, batch_1_rows),
            (batches, "token trees: adaptive with trees >= 0.97x adaptive chains only, tok/s (batches 8-64)",
             lambda v: min(v) >= 0.97, batch_rows)):
        if values:
            row(target, tables.span(values) + beside(rows_), met(values.values()))


if __name__ == "__main__":
    main()
