"""Speculative decoding on the shipped pair: costs, speedups by method and K, theory vs measured.

    python -m bench spec                       # code workload, batch 1, greedy
    python -m bench spec --workload edit       # n-gram friendly edit workload
    python -m bench spec --costs-only          # verify-pass / draft-step timings and c
    python -m bench spec --methods draft eagle hybrid-eagle --ks 3 5   # the EAGLE-3 head beside the draft

"eagle" and "hybrid-eagle" (prompt lookup, else the head) run on a second engine with the same
target and the EAGLE-3 head of --eagle, interleaved with the others; its c is the head's.

Every configuration runs in one engine (reconfigured between runs, same weights), the
configurations interleaved (A B C, C B A, ...) and repeated; medians are reported.
Theoretical speedup (Leviathan et al., Thm 3.8): (1 - a^(K+1)) / ((1 - a)(K c + 1)), with c
the draft's forward time over the target's at batch 1 (re-measured between the configurations
of every repeat; medians), which
counts a verify pass of K + 1 tokens as costing one decode step; the same bound with the measured
verify cost v (target pass of K + 1 tokens / of 1 token) is (1 - a^(K+1)) / ((1 - a)(K c + v)).
Each configuration's time per generated token is split by engine phase (draft passes, target
passes, prefill, the engine's own bookkeeping): where the time goes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import tables
from bench.common import (
    PLAIN,
    adaptive,
    add_model_options,
    fixed,
    generate_each,
    interleave,
    summarize,
    theoretical,
    write,
)
from bench.workloads import load_prompts
from engine.request import PHASES


def measure_costs(llm, batch_sizes=(1, 16), max_t: int = 9, context: int = 128, repeats: int = 15) -> dict:
    """Median forward times (ms) of the target for T = 1..max_t tokens per sequence, and of
    one draft decode step, at each batch size."""
    from engine.model.passes import forward_chunks

    eng = llm.engine
    out = {}
    for b in batch_sizes:
        row = {}
        for name, model, pool, ts in (("target", eng.model, eng.kv.target, range(1, max_t + 1)),
                                      ("draft", eng.draft_model, eng.kv.draft, [1])):
            slots = [pool.allocate_slot([])[0] for _ in range(b)]
            forward_chunks(model, pool, slots, [[(7 * i + j) % 1000 + 10 for j in range(context)] for i in range(b)],
                           [0] * b)
            for t in ts:
                times = []
                for r in range(repeats):  # the context grows by one token per repeat, as in decoding
                    t0 = time.perf_counter()
                    forward_chunks(model, pool, slots, [[11] * t] * b, [context + r] * b, all_logits=t > 1)
                    times.append(time.perf_counter() - t0)
                    for s in slots:
                        pool.truncate_to(s, context + r + 1)
                for s in slots:
                    pool.truncate_to(s, context)
                row[f"{name}_T{t}"] = statistics.median(times) * 1e3
            for s in slots:
                pool.free_slot(s)
        row["c"] = row["draft_T1"] / row["target_T1"]
        row["verify_ratio"] = {t: row[f"target_T{t}"] / row["target_T1"] for t in range(1, max_t + 1)}
        out[str(b)] = row
    return out


COSTS = "forward costs"  # the interleaved cost measurement among the configurations
EAGLE_COSTS = "eagle forward costs"
EAGLE_METHODS = {"eagle": "eagle", "hybrid-eagle": "hybrid"}  # bench name -> speculative_method on the head's engine


def eagle_engine(args, use: bool):
    """The engine with the EAGLE-3 head (same target, same plan option), or None."""
    if not use:
        return None
    from engine import LLM

    return LLM(model=args.target, draft_model=args.eagle, forward_plan=args.forward_plan, use_speculative_decoding=True,
               speculative_method="eagle", max_batch_size=16, max_seq_len=args.max_seq_len, spec_policy="fixed",
               enable_prefix_caching=False)


def interleaved_costs(rows: list[dict]) -> dict:
    """Medians over repeats of the batch-1 costs measured between configurations: c (with its
    range), the target and draft step times (ms) and the verify cost by T."""
    cs = [r["c"] for r in rows]
    return {"c": {"median": statistics.median(cs), "min": min(cs), "max": max(cs), "n": len(cs)},
            "target_T1": statistics.median(r["target_T1"] for r in rows),
            "draft_T1": statistics.median(r["draft_T1"] for r in rows),
            "verify_ratio": {t: statistics.median(r["verify_ratio"][t] for r in rows) for t in rows[0]["verify_ratio"]}}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["code", "edit"], default="code")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    ap.add_argument("--methods", nargs="+", default=["draft", "ngram", "hybrid"])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--costs-only", action="store_true")
    add_model_options(ap)
    ap.add_argument("--eagle", default="embedded:eagle3", help="the EAGLE-3 head for the eagle methods")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    return ap


def print_costs(costs: dict) -> None:
    """One line per batch size (and the EAGLE head's): step times, c and the verify cost by T."""
    for b, row in costs.items():
        print(f"{'eagle head, batch 1' if b == 'eagle' else f'batch {b}'}: "
              f"target T=1 {row['target_T1']:.2f} ms, draft step {row['draft_T1']:.2f} ms, c = {row['c']:.3f}; "
              "verify T/T1: " + " ".join(f"{t}:{r:.2f}" for t, r in row["verify_ratio"].items()))


def spec_configs(args, llm, llm_eagle) -> tuple[dict[str, dict], dict]:
    """reconfigure_speculation() settings by name (plain, each method at each K and adaptive) and
    the engine each runs on."""
    configs: dict[str, dict] = {"plain": PLAIN}
    engines = {"plain": llm}
    for m in args.methods:
        method, engine = EAGLE_METHODS.get(m, m), llm_eagle if m in EAGLE_METHODS else llm
        for name, cfg in [*((f"{m}/K={k}", fixed(method, k)) for k in args.ks), (f"{m}/adaptive", adaptive(method, max(args.ks)))]:
            configs[name], engines[name] = cfg, engine
    return configs, engines


def config_run(llm, cfg: dict, prompts: list, params_of):
    """One configuration's run: its n-th call decodes the prompts with repeat n's seeds and returns
    tok/s, the tokens, drafted / accepted tokens, rounds, rejections and ms per token by phase."""
    repeats_done = 0

    def go():
        nonlocal repeats_done
        llm.engine.reconfigure_speculation(**cfg)
        params = params_of(repeats_done)
        repeats_done += 1
        t0 = time.perf_counter()
        outs, phase_seconds = generate_each(llm, prompts, params)
        dt = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        drafted = sum(o.num_draft_tokens for o in outs)
        accepted = sum(o.num_accepted_tokens for o in outs)
        rounds = sum(o.num_spec_rounds for o in outs)
        # per-token acceptance (the paper's alpha): rounds end at the first rejection
        rejections = sum(a < k for o in outs for a, k in zip(o.accepted_per_round, o.proposed_per_round))
        return {"tok_s": n / dt, "tokens": [o.token_ids for o in outs], "drafted": drafted,
                "accepted": accepted, "rounds": rounds, "rejections": rejections,
                "ms_per_token": {ph: sec * 1e3 / n for ph, sec in phase_seconds.items()}}
    return go


def print_interleaved(in_run: dict, in_run_eagle: dict | None) -> None:
    """The batch-1 costs measured between configurations (the draft's, then the head's)."""
    c = in_run["c"]["median"]
    print(f"batch 1, measured between configurations: c = {c:.3f} (range {in_run['c']['min']:.3f} to "
          f"{in_run['c']['max']:.3f}), target T=1 {in_run['target_T1']:.2f} ms, draft step {in_run['draft_T1']:.2f} ms")
    if in_run_eagle is not None:
        print(f"eagle head: c = {in_run_eagle['c']['median']:.3f} (range {in_run_eagle['c']['min']:.3f} to "
              f"{in_run_eagle['c']['max']:.3f}), head step {in_run_eagle['draft_T1']:.2f} ms")


def add_theory(entry: dict, alpha_token: float, k: int, model_costs: dict) -> None:
    """Thm 3.8's speedup beside the measured one: with a verify pass costing one decode step, and
    with its measured cost (when measured for K + 1 tokens)."""
    entry["theoretical_speedup"] = theoretical(alpha_token, k, model_costs["c"]["median"])
    entry["measured_over_theoretical"] = entry["speedup"] / entry["theoretical_speedup"]
    verify_cost = model_costs["verify_ratio"].get(k + 1)
    if verify_cost is not None:
        entry["theoretical_speedup_verify_cost"] = theoretical(alpha_token, k, model_costs["c"]["median"],
                                                               verify_cost)
        entry["measured_over_theoretical_verify_cost"] = \
            entry["speedup"] / entry["theoretical_speedup_verify_cost"]


def config_entry(name: str, rs: list[dict], cfg: dict, plain_runs: list[dict], temperature: float,
                 in_run: dict, in_run_eagle: dict | None) -> dict:
    """One configuration's row of the results: speed and speedup over plain, acceptance, identity
    with plain's outputs, ms per token by phase and (fixed K, draft or head) the theory's speedup."""
    s = summarize(rs, "tok_s")
    plain = summarize(plain_runs, "tok_s")["median"]
    # acceptance over every repeat's texts (at temperature 0 the repeats repeat one text)
    drafted, accepted, rounds, rejections = (sum(r[key] for r in rs)
                                             for key in ("drafted", "accepted", "rounds", "rejections"))
    alpha = accepted / drafted if drafted else None
    k = cfg.get("spec_length", 0) if cfg["use_speculative_decoding"] else 0
    alpha_token = accepted / (accepted + rejections) if drafted else None
    entry = {"tok_s": s, "speedup": s["median"] / plain, "acceptance": alpha, "alpha_per_token": alpha_token,
             "mean_accepted_length": accepted / rounds if rounds else None,
             # share of (prompt, repeat) greedy outputs equal to plain's, token for token
             "identical_to_plain": statistics.fmean(a == b for r, p in zip(rs, plain_runs)
                                                    for a, b in zip(r["tokens"], p["tokens"]))
             if temperature == 0 else None,
             # median over repeats of each phase's milliseconds per generated token
             "ms_per_token": {ph: statistics.median(r["ms_per_token"][ph] for r in rs) for ph in PHASES}}
    model_costs = in_run_eagle if name.startswith("eagle") else in_run if name.startswith("draft") else None
    if alpha is not None and cfg.get("spec_policy") == "fixed" and model_costs is not None:
        add_theory(entry, alpha_token, k, model_costs)
    theo = f"  theory {entry['theoretical_speedup']:.2f}x ({entry['measured_over_theoretical']:.0%})" \
        if "theoretical_speedup" in entry else ""
    print(f"{name:18s} {s['median']:8.1f} tok/s  {entry['speedup']:5.2f}x  "
          f"acc {alpha if alpha is None else round(alpha, 3)}  same={entry['identical_to_plain']}{theo}")
    return entry


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams

    llm = LLM(model=args.target, draft_model=args.draft, forward_plan=args.forward_plan,  # prefix caching off:
              use_speculative_decoding=True, max_batch_size=16, max_seq_len=args.max_seq_len,  # every repeat
              spec_policy="fixed", enable_prefix_caching=False)  # of a prompt is a fresh request
    llm_eagle = eagle_engine(args, any(m in EAGLE_METHODS for m in args.methods))
    costs = measure_costs(llm)
    if llm_eagle is not None:
        costs["eagle"] = measure_costs(llm_eagle, batch_sizes=(1,))["1"]
    print_costs(costs)
    if args.costs_only:
        write("spec_costs", {"costs": costs}, llm)
        return
    prompts = load_prompts(args.workload, args.prompts)
    # Repeat r samples prompt i with seed r * prompts + i, the same seeds for every configuration:
    # at temperature > 0 each configuration is judged on as many sampled texts as prompts x
    # repeats, and the configurations of one repeat on the same seeds (with one seed for every
    # run, each configuration would be judged on its own single text per prompt).
    def params_of(repeat: int) -> list:
        return [SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True,
                               seed=repeat * len(prompts) + i) for i in range(len(prompts))]
    configs, engines = spec_configs(args, llm, llm_eagle)
    # the batch-1 forward costs are re-measured between the configurations of every repeat: the
    # theory's c and verify costs come from the same stretch of time as the speeds they judge
    # (one measurement at the start can catch a slow moment of a shared host)
    variants = {COSTS: lambda: measure_costs(llm, batch_sizes=(1,), repeats=9)["1"],
                **{name: config_run(engines[name], cfg, prompts, params_of) for name, cfg in configs.items()}}
    if llm_eagle is not None:
        variants[EAGLE_COSTS] = lambda: measure_costs(llm_eagle, batch_sizes=(1,), repeats=9)["1"]
    runs = interleave(variants, args.repeats, f"{args.workload} configs")
    in_run = interleaved_costs(runs.pop(COSTS))
    in_run_eagle = interleaved_costs(runs.pop(EAGLE_COSTS)) if llm_eagle is not None else None
    print_interleaved(in_run, in_run_eagle)
    table = {name: config_entry(name, rs, configs[name], runs["plain"], args.temperature, in_run, in_run_eagle)
             for name, rs in runs.items()}
    path = write(f"spec_{args.workload}_t{args.temperature:g}", {
        "workload": args.workload, "prompts": len(prompts), "tokens": args.tokens, "temperature": args.temperature,
        "repeats": args.repeats, "seeds": "repeat * prompts + prompt index", "costs": costs,
        "costs_interleaved": in_run, "costs_interleaved_eagle": in_run_eagle, "results": table}, llm)
    print(f"wrote {path}")


def _seeds(r: dict) -> str:
    """How a sampled spec run chose its seeds (runs before the per-repeat seeds used one seed)."""
    if r["temperature"] == 0:
        return ""
    if "seeds" in r:
        return (f", each repeat on its own seeds ({r['prompts'] * r['repeats']} sampled texts per configuration, "
                "the same seeds for every configuration of a repeat)")
    return ", one seed for every run (each configuration judged on its own sampled text per prompt)"


def _spec_table(r: dict) -> list[str]:
    m = r["machine"]
    costs = r["costs_interleaved"]  # batch 1, measured between the configurations of every repeat
    c = (f"c = {costs['c']['median']:.3f}, range {costs['c']['min']:.3f} to {costs['c']['max']:.3f} over "
         f"the repeats ({costs['draft_T1']:.2f} ms draft step / {costs['target_T1']:.2f} ms target step, "
         "forward passes alone, measured between the configurations)")
    lines = [f"**Speculative decoding on the shipped pair** — workload `{r['workload']}`, {r['prompts']} held-out "
             f"prompts, {r['tokens']} new tokens, temperature {r['temperature']}, batch 1, medians of {r['repeats']} "
             f"interleaved runs{_seeds(r)}; {c}; {tables.plan(r)}; {tables.host(m)}, {m['threads']} threads "
             f"(`python -m bench spec --workload {r['workload']}"
             f"{'' if r['temperature'] == 0 else ' --temperature ' + format(r['temperature'], 'g')}`):", "",
             "| config | tok/s | speedup | acceptance | accepted/round | outputs identical to plain | theory (Thm 3.8) "
             "| measured ÷ theory | ÷ theory with measured verify cost | ms per token: draft / target / rest |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in r["results"].items():
        acc = f"{e['acceptance']:.3f}" if e["acceptance"] is not None else "-"
        mal = f"{e['mean_accepted_length']:.2f}" if e["mean_accepted_length"] is not None else "-"
        theo = f"{e['theoretical_speedup']:.2f}x" if "theoretical_speedup" in e else "-"
        ratio = f"{e['measured_over_theoretical']:.0%}" if "measured_over_theoretical" in e else "-"
        ratio_v = f"{e['measured_over_theoretical_verify_cost']:.0%}" \
            if "measured_over_theoretical_verify_cost" in e else "-"
        same = "-" if e["identical_to_plain"] is None else f"{e['identical_to_plain']:.0%}"
        ms = e.get("ms_per_token")
        split = "-" if ms is None else \
            f"{ms['draft']:.2f} / {ms['target']:.2f} / {ms['prefill'] + ms['other']:.2f}"
        lines.append(f"| {name} | {e['tok_s']['median']:.0f} | {e['speedup']:.2f}x | {acc} | {mal} | {same} | "
                     f"{theo} | {ratio} | {ratio_v} | {split} |")
    return lines + ["", "Rest = prefill + the engine's own work per step (scheduling, KV bookkeeping, "
                    "detokenizing); the three add up to the time per generated token.", ""]


def _costs_table(r: dict) -> list[str]:
    lines = [f"**Forward-pass costs** (ms, median; T = tokens per sequence in one target pass), from the "
             f"`{r['workload']}` spec run above, {tables.host(r['machine'])}:", "",
             "| batch | " + " | ".join(f"T={t}" for t in range(1, 10)) + " | draft step | c |",
             "| --- |" + " --- |" * 11]
    for b, row in r["costs"].items():
        lines.append(f"| {b} | " + " | ".join(f"{row[f'target_T{t}']:.2f}" for t in range(1, 10))
                     + f" | {row['draft_T1']:.2f} | {row['c']:.3f} |")
    return lines + [""]


def _best(results: dict, prefix: str) -> tuple[str, float]:
    """The fastest variant whose name starts with prefix: (name, speedup over plain)."""
    name = max((n for n in results if n.startswith(prefix)), key=lambda n: results[n]["speedup"])
    return name, results[name]["speedup"]


def _eagle_bound(r: dict) -> str:
    """The best speedup Thm 3.8 allows the head on the run's host: its measured per-token α (best
    fixed K), its c and the target's measured verify costs, at the best K."""
    costs = r.get("costs_interleaved_eagle")
    fixed_k = [e for n, e in r["results"].items() if n.startswith("eagle/K=")]
    if costs is None or not fixed_k:
        return ""
    alpha, c, verify = max(e["alpha_per_token"] for e in fixed_k), costs["c"]["median"], costs["verify_ratio"]
    bound, k = max((theoretical(alpha, k, c, verify[str(k + 1)]), k) for k in range(1, len(verify)))
    return (f" (bound on this host {bound:.2f}x at K = {k}: Thm 3.8 with α {alpha:.3f}, c {c:.3f} and the measured "
            "verify costs)")


def page_table() -> list[str]:
    """The results page's tables: each spec run's, with its plot, then the first run's pass costs."""
    out, first = [], None
    for name in ("spec_code_t0", "spec_edit_t0", "spec_code_t0.8"):
        if (r := tables.load(name)) is not None:
            out += _spec_table(r) + tables.img(name)
            first = first or r
    return out + ([] if first is None else _costs_table(first))


def page_targets(row: tables.Row) -> None:
    """The batch-1 speedup, theory and EAGLE-3 targets, from the spec runs."""
    code, edit = tables.load("spec_code_t0"), tables.load("spec_edit_t0")
    if code is not None:
        res = code["results"]
        for method, goal in (("draft", 2.0), ("hybrid", 2.5)):
            name, best = _best(res, method + "/")
            adaptive = res[f"{method}/adaptive"]["speedup"]
            row(f"batch 1, greedy, code: {method} >= {goal}x plain", f"{adaptive:.2f}x adaptive, best {best:.2f}x ({name})",
                best >= goal)
        ratios = [e["measured_over_theoretical"] for e in res.values() if "measured_over_theoretical" in e]
        with_verify = [e["measured_over_theoretical_verify_cost"] for e in res.values()
                       if "measured_over_theoretical_verify_cost" in e]
        if ratios:
            extra = f" (bound with the measured verify cost: {min(with_verify):.0%} to {max(with_verify):.0%})" \
                if with_verify else ""
            row("measured >= 90% of the theoretical speedup (Thm 3.8, draft and eagle, fixed K)",
                f"{min(ratios):.0%} to {max(ratios):.0%}{extra}", min(ratios) >= 0.9)
        if "eagle/adaptive" in res:
            alpha = max(e["alpha_per_token"] for n, e in res.items() if n.startswith("eagle/K="))
            row("EAGLE-3 head: per-token α >= 0.88 (batch 1, greedy, code)", f"{alpha:.3f}", alpha >= 0.88)
            for name, goal in (("eagle", 2.5), ("hybrid-eagle", 2.8)):
                adaptive = res[f"{name}/adaptive"]["speedup"]
                bound = _eagle_bound(code) if name == "eagle" else ""
                row(f"batch 1, greedy, code: {name} adaptive >= {goal}x plain", f"{adaptive:.2f}x{bound}",
                    adaptive >= goal)
    if (warm := tables.load("spec_code_t0.8")) is not None and "eagle/adaptive" in warm["results"]:
        adaptive = warm["results"]["eagle/adaptive"]["speedup"]
        row("batch 1, temperature 0.8, code: eagle adaptive >= 1.8x plain", f"{adaptive:.2f}x{_eagle_bound(warm)}",
            adaptive >= 1.8)
    if edit is not None:
        name, best = _best(edit["results"], "ngram/")
        adaptive = edit["results"]["ngram/adaptive"]["speedup"]
        row("batch 1, greedy, edit: ngram >= 2.0x plain", f"{adaptive:.2f}x adaptive, best {best:.2f}x ({name})",
            best >= 2.0)


if __name__ == "__main__":
    main()
