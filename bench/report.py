"""Regenerates the benchmark tables from bench/results/*.json.

    python -m bench report   # rewrites docs/benchmarks/results.md (between its bench markers) and
                             # the README's headline table (between its headline markers)
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from bench.common import RESULTS, host_class, theoretical
from engine.model.plan import label

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS_PAGE = ROOT / "docs" / "benchmarks" / "results.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
HEADLINE_START, HEADLINE_END = "<!-- headline:start -->", "<!-- headline:end -->"
IMAGES = "../../bench/results"  # from docs/benchmarks/results.md (the site build copies the plots)


def _replace_block(text: str, start: str, end: str, body: str, name: str = "the page") -> str:
    if start not in text or end not in text:
        raise SystemExit(f"{name} lacks the {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + "\n" + body + "\n" + end + tail


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _host(m: dict) -> str:
    """The host class and the day a result was measured."""
    return f"{host_class(m)}, measured {m['time'][:10]}"


def _plan(r: dict) -> str:
    """The forward plan the run's engine used."""
    plan = r.get("forward_plan")
    if not plan:
        return "forward plan not recorded"
    return "forward plan: " + ", ".join(f"{role} {label(p)}" for role, p in plan.items())


def engine_vs_hf(r: dict) -> list[str]:
    m = r["machine"]
    lines = [f"**Plain decode, our engine vs transformers `generate`** — random-init {r['params_m']}M Llama, "
             f"{r['dtype']}, {r['tokens']} new tokens, {_host(m)}, {m['threads']} threads, torch {m['torch']} "
             "(`python -m bench hf`):", "",
             "| batch | ours tok/s | transformers tok/s | ratio |", "| --- | --- | --- | --- |"]
    for b, row in r["results"].items():
        lines.append(f"| {b} | {row['ours']['median']:.0f} | {row['transformers']['median']:.0f} | "
                     f"{row['ratio']:.2f}x |")
    return lines + [""]


def _seeds(r: dict) -> str:
    """How a sampled spec run chose its seeds (runs before the per-repeat seeds used one seed)."""
    if r["temperature"] == 0:
        return ""
    if "seeds" in r:
        return (f", each repeat on its own seeds ({r['prompts'] * r['repeats']} sampled texts per configuration, "
                "the same seeds for every configuration of a repeat)")
    return ", one seed for every run (each configuration judged on its own sampled text per prompt)"


def spec(r: dict) -> list[str]:
    m = r["machine"]
    costs = r["costs_interleaved"]  # batch 1, measured between the configurations of every repeat
    c = (f"c = {costs['c']['median']:.3f}, range {costs['c']['min']:.3f} to {costs['c']['max']:.3f} over "
         f"the repeats ({costs['draft_T1']:.2f} ms draft step / {costs['target_T1']:.2f} ms target step, "
         "forward passes alone, measured between the configurations)")
    lines = [f"**Speculative decoding on the shipped pair** — workload `{r['workload']}`, {r['prompts']} held-out "
             f"prompts, {r['tokens']} new tokens, temperature {r['temperature']}, batch 1, medians of {r['repeats']} "
             f"interleaved runs{_seeds(r)}; {c}; {_plan(r)}; {_host(m)}, {m['threads']} threads "
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


def costs_table(r: dict) -> list[str]:
    lines = [f"**Forward-pass costs** (ms, median; T = tokens per sequence in one target pass), from the "
             f"`{r['workload']}` spec run above, {_host(r['machine'])}:", "",
             "| batch | " + " | ".join(f"T={t}" for t in range(1, 10)) + " | draft step | c |",
             "| --- |" + " --- |" * 11]
    for b, row in r["costs"].items():
        lines.append(f"| {b} | " + " | ".join(f"{row[f'target_T{t}']:.2f}" for t in range(1, 10))
                     + f" | {row['draft_T1']:.2f} | {row['c']:.3f} |")
    return lines + [""]


def _img(name: str) -> list[str]:
    return [f"![{name}]({IMAGES}/{name}.png)", ""] if (RESULTS / f"{name}.png").exists() else []


def peers(r: dict) -> list[str]:
    m = r["machine"]
    lines = [f"**Peers on the same weights** — the shipped pair in bf16, batch 1, greedy, {r['tokens']} new tokens, "
             f"{r['prompts']} held-out prompts per workload, medians of {r['repeats']} interleaved runs, "
             f"{m['threads']} threads, {_host(m)}; ours: {_plan(r)} (`python -m bench peers`):", "",
             "| workload | variant | tok/s | vs transformers plain | vs transformers assisted | same tokens as own plain |",
             "| --- | --- | --- | --- | --- | --- |"]
    for w, block in r["workloads"].items():
        for name, e in block["results"].items():
            lines.append(f"| {w} | {name} | {e['tok_s']['median']:.0f} | {e['vs_transformers_plain']:.2f}x | "
                         f"{e['vs_transformers_assisted']:.2f}x | {e['same_as_plain']:.0%} |")
    lines += ["", "Our plain greedy tokens vs transformers' plain greedy tokens (bf16, different kernels): " + ", ".join(
        f"{w} {b['ours_plain_matches_transformers_plain']:.0%} positions equal" for w, b in r["workloads"].items()), ""]
    return lines + _img("peers")


def plans(r: dict) -> list[str]:
    m, res, auto = r["machine"], r["results"], r["auto"]
    lines = [f"**Forward plan: measured (auto) vs the others** — workload `{r['workload']}`, greedy, {r['tokens']} new "
             f"tokens, batch 1 ({r['prompts']} prompts one at a time) and 16, medians of {r['repeats']} interleaved "
             f"runs, {_host(m)}, {m['threads']} threads (`python -m bench plan`); auto: {auto}. One engine per plan: "
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


def llama_cpp(r: dict) -> list[str]:
    if r.get("status") != "measured":
        return [f"**llama.cpp**: {r.get('status')}", ""]
    lines = [f"**llama.cpp** (llama-cpp-python {r['llama_cpp_python']}, the shipped target converted to GGUF "
             f"{r['gguf']}, batch 1, greedy, {r['tokens']} new tokens, {_host(r['machine'])}, "
             f"{r['machine']['threads']} threads; `python -m bench llamacpp`):", "",
             "| workload | variant | tok/s | vs llama.cpp plain | same tokens as llama.cpp plain |",
             "| --- | --- | --- | --- | --- |"]
    for w, table in r["workloads"].items():
        for name, e in table.items():
            lines.append(f"| {w} | {name} | {e['tok_s']['median']:.0f} | {e['vs_llama_cpp_plain']:.2f}x | "
                         f"{e['same_as_llama_cpp_plain']:.0%} |")
    return lines + [""]


def _paired(row: dict, key: str = "adaptive_vs_best_paired") -> str:
    p = row[key]
    return f"{p['median']:.3f} ({p['min']:.2f}-{p['max']:.2f})"


def sweep(r: dict, image: str = "sweep") -> list[str]:
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
             f"medians of {r['repeats']} interleaved runs (`python -m bench sweep`); {_plan(r)}; {_host(r['machine'])}"
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
    return lines + [""] + _img(image)


def serve(r: dict) -> list[str]:
    slo = r["slo"]
    lines = [f"**Serving sweep with guidellm** — `serve run serve_config.yaml` (one replica, {r['engine_threads']} "
             f"engine thread), {_host(r['machine'])}; per level, each mode applied live (`serve deploy` of its user_config) "
             f"then `guidellm run` with that many concurrent streams, {r['tokens']} output tokens a request over the "
             f"code prompts, greedy; medians of {r['repeats']} interleaved repeats (`python -m bench serve`). "
             f"Goodput: requests/s with TTFT ≤ {slo['ttft_ms']:.0f} ms and mean inter-token latency ≤ "
             f"{slo['itl_ms']:.0f} ms. One run's command, against `serve run serve_config.yaml` on port 8000 "
             "(`prompts.jsonl`: the code prompts, a `{\"prompt\", \"output_tokens_count\"}` object a line):", "", f"`{r['guidellm_command']}`", "",
             "| streams | mode | output tok/s (range) | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | goodput (req/s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for level, row in r["results"].items():
        for name, m in row["modes"].items():
            goodput = "" if m["goodput_rps"] is None else f"{m['goodput_rps']:.2f}"
            lines.append(f"| {level} | {name} | {m['tok_s']:.0f} ({m['tok_s_range'][0]:.0f}–{m['tok_s_range'][1]:.0f}) | "
                         f"{m['ttft_ms']['p50']:.0f} / {m['ttft_ms']['p95']:.0f} | {m['itl_ms']['p50']:.1f} / "
                         f"{m['itl_ms']['p95']:.1f} | {goodput} |")
    lines += ["", "Adaptive ÷ max(plain, best fixed K), output tokens/s: " + ", ".join(
        f"{lv} streams {row['adaptive_over_best']:.3f} ({row['best_fixed']})" for lv, row in r["results"].items()),
        "", "HTTP ÷ in-process (the serving layer's share): " + ", ".join(
        f"{lv} streams " + " / ".join(f"{m} {v:.2f}" for m, v in row["http_over_in_process"].items())
        for lv, row in r["results"].items()), ""]
    return lines + _img("serve")


def structured(r: dict) -> list[str]:
    lines = [f"**Structured outputs** — the code prompts decoded freely or under a JSON schema (six objects of "
             f"names, argument lists and return types), {r['tokens']} tokens a request, greedy, {_host(r['machine'])}, "
             f"{_plan(r)}; tokens/s end to end, medians of {r['repeats']} interleaved repeats with their range "
             "(`python -m bench structured`). *Kept*: constrained speedup ÷ free speedup. *Grammar*: the share of "
             "wall time inside grammar calls (masks filled and applied, walks ahead, commits).", "",
             "| batch | speculation | free tok/s | constrained tok/s | free speedup | constrained speedup | kept | "
             "grammar share |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b, row in r["results"].items():
        for name in [n.removeprefix("free ") for n in row if n.startswith("free ")]:
            free, con = row[f"free {name}"], row[f"constrained {name}"]
            gain = row.get(f"{name} speedup")
            cells = ["", "", ""] if gain is None else [f"{gain['free']:.2f}x", f"{gain['constrained']:.2f}x",
                                                       f"{gain['kept']:.3f}"]
            lines.append(f"| {b} | {name} | {free['tok_s']['median']:.0f} ({free['tok_s']['min']:.0f}–"
                         f"{free['tok_s']['max']:.0f}) | {con['tok_s']['median']:.0f} ({con['tok_s']['min']:.0f}–"
                         f"{con['tok_s']['max']:.0f}) | " + " | ".join(cells) + f" | {con['grammar_share']:.1%} |")
    return lines + [""]


TREE_RESULTS = ("trees", "trees_eagle", "trees_eagle_8nodes", "trees_draft")  # bench trees runs, by method and size


def _tree_runs() -> list[dict]:
    """The bench trees runs; a later `--skip-batch-1` run (<name>_batches.json) replaces its
    run's batches."""
    runs = []
    for name in TREE_RESULTS:
        if (r := _load(name)) is None:
            continue
        if (later := _load(f"{name}_batches")) is not None and later["results"].get("batches"):
            r = {**r, "results": {**r["results"], "batches": later["results"]["batches"]},
                 "batches_machine": later["machine"]}
        runs.append(r)
    return runs


def _spread(d: dict, pooled: bool = True) -> str:
    """A ratio's median [min, max] over repeats, and its pooled value where recorded."""
    out = f"{d['median']:.3f} [{d['min']:.3f}, {d['max']:.3f}]"
    return out + (f" (pooled {d['pooled']:.3f})" if pooled and "pooled" in d else "")


def trees(runs: list[dict]) -> list[str]:
    """Token trees vs chains at batch 1, one row per run and temperature; then the batch runs."""
    first = runs[0]
    lines = [f"**Token trees vs chains** — the shipped target, {first['workload']} prompts one at a time (batch 1), "
             f"K = {first['k']}, medians over repeats (each its own seeds) with their range; {_host(first['machine'])} "
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
                         f"{_spread(row['tree_over_chain_accepted_per_round'])} | "
                         f"{_spread(row['adaptive_tree_over_chain_tok_s'])} | "
                         f"{_spread(row['a_a_chain_over_chain_tok_s']) if 'a_a_chain_over_chain_tok_s' in row else '—'} | "
                         f"{_fixed_and_ceiling(row)} | "
                         f"{theory[f'chain K={k}']['measured_over_theoretical']:.2f} / "
                         f"{theory[f'tree K={k}']['measured_over_theoretical']:.2f} |")
    batches = [r for r in runs if r["results"].get("batches")]
    for r in batches:
        lines += ["", f"Batches of the same prompts (repeated to fill), greedy, {r['method']} trees of up to {r['nodes']} "
                  f"nodes, width {r['width']}; adaptive with trees ÷ adaptive chains only, tok/s (goal: at least 0.97), "
                  f"{_host(r.get('batches_machine', r['machine']))}: " + ", ".join(
                      f"batch {b} {_spread(row['adaptive_tree_over_chain_tok_s'])}" for b, row in r["results"]["batches"].items())]
        a_a = {b: row["a_a_chain_over_chain_tok_s"] for b, row in r["results"]["batches"].items() if "a_a_chain_over_chain_tok_s" in row}
        if a_a:  # the chain-only variant run twice a repeat: how far two identical variants differ here
            lines[-1] += ("; two runs of the chain-only variant against each other (A/A): "
                          + ", ".join(f"batch {b} {_spread(x)}" for b, x in a_a.items()))
    return lines + [""]


def _fixed_and_ceiling(row: dict) -> str:
    """A batch-1 row's fixed-K tree ÷ chain tok/s and its drafting-free ceiling ("—" for runs without)."""
    if "drafting_free_ceiling" not in row:
        return "—"
    return f"{_spread(row['fixed_tree_over_chain_tok_s'])}; {_spread(row['drafting_free_ceiling'])}"


def verification(r: dict) -> list[str]:
    lines = [f"**Block vs token verification** — the shipped pair at T = {r['temperature']}, {r['prompts']} code "
             f"prompts x {r['tokens']} tokens one at a time (batch 1), {r['repeats']} repeats with their own seeds, "
             f"each prompt decoded by both rules back to back; {_host(r['machine'])} (`python -m bench verification`). "
             "*Expected on the same rounds*: both rules' expected accepted tokens computed from each verified round's "
             "p, q and proposal, free of the draws' noise (goals: block ÷ token at least 1.0).", "",
             "| proposer | K | accepted/round token → block | block ÷ token, accepted | expected on the same rounds | "
             "block ÷ token, tok/s |", "| --- | --- | --- | --- | --- | --- |"]
    for method, row in r["results"].items():
        for shape in (n for n in row if n != "variants"):
            e = row[shape]
            accepted = dict(e["block_over_token_accepted"])
            if "block_over_token_accepted_pooled" in e:
                accepted["pooled"] = e["block_over_token_accepted_pooled"]
            lines.append(f"| {method} | {shape.removeprefix('K=')} | {e['accepted_per_round']['token']:.2f} → "
                         f"{e['accepted_per_round']['block']:.2f} | {_spread(accepted)} | "
                         f"{_spread(e['expected_block_over_token_same_rounds'])} | {_spread(e['block_over_token_tok_s'])} |")
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


def summary() -> str:
    """The issue's targets next to what the committed results show."""
    rows = []

    def row(target: str, measured: str, met: bool) -> None:
        rows.append(f"| {target} | {measured} | {'yes' if met else '**no**'} |")

    code, edit = _load("spec_code_t0"), _load("spec_edit_t0")
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
    if (warm := _load("spec_code_t0.8")) is not None and "eagle/adaptive" in warm["results"]:
        adaptive = warm["results"]["eagle/adaptive"]["speedup"]
        row("batch 1, temperature 0.8, code: eagle adaptive >= 1.8x plain", f"{adaptive:.2f}x{_eagle_bound(warm)}",
            adaptive >= 1.8)
    if edit is not None:
        name, best = _best(edit["results"], "ngram/")
        adaptive = edit["results"]["ngram/adaptive"]["speedup"]
        row("batch 1, greedy, edit: ngram >= 2.0x plain", f"{adaptive:.2f}x adaptive, best {best:.2f}x ({name})",
            best >= 2.0)
    if (r := _load("peers")) is not None:
        parts, met = [], True
        for w, block in r["workloads"].items():
            res = block["results"]
            same_draft = res["ours draft (adaptive)"]["vs_transformers_assisted"]  # the same draft model
            ours = {n: e for n, e in res.items() if n.startswith("ours") and "plain" not in n}
            name = max(ours, key=lambda n: ours[n]["vs_transformers_assisted"])
            parts.append(f"{w}: draft {same_draft:.2f}x, best {ours[name]['vs_transformers_assisted']:.2f}x ({name})")
            met &= same_draft >= 2.0
        row("our speculative decoding (same draft) >= 2x transformers assisted generation", "; ".join(parts), met)
    for name, what in (("sweep", "adaptive"), ("sweep_eagle", "adaptive with the EAGLE-3 head")):
        if (r := _load(name)) is None:
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
    if (r := _load("serve")) is not None:
        ratios = {lv: row_["adaptive_over_best"] for lv, row_ in r["results"].items()}
        worst = min(ratios, key=ratios.get)
        row("serving (guidellm): adaptive >= 0.97 x max(plain, best fixed K) at every concurrency",
            f"{min(ratios.values()):.3f} ({worst} streams) to {max(ratios.values()):.3f}", min(ratios.values()) >= 0.97)
        if "1" in r["results"]:
            one = r["results"]["1"]["adaptive_over_plain"]
            row("serving (guidellm): adaptive >= 1.8x plain at concurrency 1", f"{one:.2f}x", one >= 1.8)
    if (r := _load("structured")) is not None:
        kept = {f"batch {b} {n.removesuffix(' speedup')}": v["kept"] for b, row_ in r["results"].items()
                for n, v in row_.items() if n.endswith(" speedup")}
        worst = min(kept, key=kept.get)
        row("structured outputs: constrained speculation keeps >= 90% of the free speedup",
            f"{min(kept.values()):.3f} ({worst}) to {max(kept.values()):.3f}", min(kept.values()) >= 0.9)
    if (r := _load("plans")) is not None:
        ratios = {k: e["auto_over_best_other"]["median"] for k, e in r["results"].items()}
        worst = min(ratios, key=ratios.get)
        row("forward plan: auto within 5% of the best other plan (plain, draft K=5, hybrid adaptive; batch 1 and 16)",
            f"{min(ratios.values()):.3f} ({worst}) to {max(ratios.values()):.3f}", min(ratios.values()) >= 0.95)
    def span(values: dict[str, float]) -> str:  # "lowest (its name) to highest"
        worst = min(values, key=values.get)
        return f"{values[worst]:.3f} ({worst}) to {max(values.values()):.3f}"

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
            row(target, span(values) + beside(rows_), met(values.values()))
    if (r := _load("verification")) is not None:
        for key, what in (("block_over_token_accepted", "accepted tokens per round"), ("block_over_token_tok_s", "tok/s")):
            ratios = {f"{m} {shape}": e[key]["median"] for m, row_ in r["results"].items()
                      for shape, e in row_.items() if shape != "variants"}
            row(f"block ÷ token verification >= 1.0, {what} (batch 1, T = {r['temperature']})", span(ratios),
                min(ratios.values()) >= 1.0)
    if not rows:
        return ""
    return "\n".join(["**Targets** (the project's goals, from the results below):", "", "| target | measured | met |",
                      "| --- | --- | --- |", *rows, ""])


def startup(r: dict) -> list[str]:
    lines = [f"**Start-up** — {r['config']}; each start in a fresh process, cold (empty caches) and warm (the "
             f"caches the cold start wrote), medians of {r['after']['llm']['cold']['summary']['n']}; "
             f"{_host(r['machine'])} (`python -m bench startup`):", "",
             "| what | cold (s) | warm (s) |", "| --- | --- | --- |"]
    names = {"llm": "`LLM(...)` constructed", "serve": "`serve run` to the first answered request"}
    for what, name in names.items():
        if what in r["after"]:
            e = r["after"][what]
            lines.append(f"| {name} | {e['cold']['summary']['median']:.1f} | {e['warm']['summary']['median']:.1f} |")
    return lines + [""]


def _short(m: dict) -> str:
    return f"{host_class(m)}, {m['time'][:10]}"


def headline() -> str:
    """Five figures for the README, each with its host and date."""
    rows = []
    if (r := _load("spec_code_t0")) is not None:
        name = next((n for n in ("hybrid-eagle/adaptive", "hybrid/adaptive") if n in r["results"]), None)
        if name:
            what = {"hybrid-eagle/adaptive": "prompt lookup, else the EAGLE-3 head (hybrid), adaptive",
                    "hybrid/adaptive": "prompt lookup, else the draft model (hybrid), adaptive"}[name]
            rows.append((f"code completion, batch 1, greedy: {what}, vs plain decoding",
                         f"{r['results'][name]['speedup']:.2f}x", _short(r["machine"])))
    if (r := _load("spec_edit_t0")) is not None and "ngram/adaptive" in r["results"]:
        rows.append(("editing, batch 1, greedy: n-gram prompt lookup, adaptive, vs plain decoding",
                     f"{r['results']['ngram/adaptive']['speedup']:.2f}x", _short(r["machine"])))
    if (r := _load("serve")) is not None:
        if "1" in r["results"]:
            rows.append(("served over HTTP, one stream: adaptive vs plain decoding",
                         f"{r['results']['1']['adaptive_over_plain']:.2f}x", _short(r["machine"])))
        ratios = [row["adaptive_over_best"] for row in r["results"].values()]
        levels = list(r["results"])
        rows.append((f"served over HTTP, {levels[0]} to {levels[-1]} streams: adaptive ÷ the best of plain and "
                     "every fixed K at each load", f"{min(ratios):.3f} to {max(ratios):.3f}", _short(r["machine"])))
    if (r := _load("peers")) is not None and "code" in r["workloads"]:
        e = r["workloads"]["code"]["results"]["ours draft (adaptive)"]
        rows.append(("vs transformers assisted generation with the same draft model, batch 1, code",
                     f"{e['vs_transformers_assisted']:.2f}x", _short(r["machine"])))
    return "\n".join(["| measured | figure | host, date |", "| --- | --- | --- |",
                      *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def quantized(r: dict) -> list[str]:
    rows = r["formats"]
    lines = [f"**Weight-only quantization** — a {r['shape']}-shaped random model, plain batch-1 decoding, "
             f"{r['repeats']} interleaved repeats (the first dropped), median step [range]; {_host(r['machine'])} "
             "(`python -m bench quantized`). Bytes: the layers' linears with scales and zero points ÷ bf16's, "
             "then the whole model (the embedding stays bf16).", "",
             "| format | step, ms | bf16 ÷ this | linears' bytes ÷ bf16 | whole model |", "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        step = row["step_ms"]
        ratio = f"{row['bf16_step_over_this']:.2f}x" if name != "bf16" else "1"
        lines.append(f"| {row['format']} | {step['median']:.1f} [{step['min']:.1f}, {step['max']:.1f}] | {ratio} | "
                     f"{row.get('linear_bytes_over_bf16', 1.0):.3f} | {row.get('bytes_over_bf16', 1.0):.3f} |")
    return lines + [""]


def moe(r: dict) -> list[str]:
    lines = [f"**A mixture of experts** — {r['shape']} (128 experts, top 8), a pair at greedy alpha "
             f"{r['pair']['teacher_forced']['greedy']:.2f} with its one-layer prefix draft, float32, greedy, "
             f"{r['repeats']} interleaved repeats, median tok/s [range]; {_host(r['machine'])} (`python -m bench moe`).", "",
             "| batch | transformers | plain | fixed K = 2 | fixed K = 4 | adaptive | adaptive ÷ best fixed K |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for batch, row in r["batches"].items():
        v = row["variants"]
        cells = [f"{v[n]['tok_s']['median']:.0f} [{v[n]['tok_s']['min']:.0f}, {v[n]['tok_s']['max']:.0f}]"
                 for n in ("plain", "fixed K=2", "fixed K=4", "adaptive")]
        lines.append(f"| {batch} | {row['transformers_tok_s']['median']:.0f} | {' | '.join(cells)} | "
                     f"{row['adaptive_over_best_fixed']:.3f} |")
    return lines + [""]


def mixed(r: dict, halves: dict | None) -> list[str]:
    """A K per request on the mixed batch (and uniform ones): each variant ÷ plain, and per-request ÷ one K."""
    workload = {"mix": "edits greedy and code at T = 0.8, half each", "edit": "all edits (greedy)",
                "code": "all code at T = 0.8"}[r["workload"]]
    names = list(next(iter(r["results"].values())))
    lines = [f"**A K per request, {workload}** — `hybrid` (prompt lookup, else the EAGLE-3 head), "
             f"{r['tokens']} tokens a request, {r['repeats']} interleaved repeats: median tok/s ÷ plain, and "
             f"per-request K ÷ one K paired per repeat, median [range]; {_host(r['machine'])} "
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


def build() -> str:
    out: list[str] = []
    if (targets := summary()):
        out += [targets]
    if (r := _load("engine_vs_hf")) is not None:
        out += engine_vs_hf(r)
    first_spec = None
    for name in ("spec_code_t0", "spec_edit_t0", "spec_code_t0.8"):
        if (r := _load(name)) is not None:
            out += spec(r) + _img(name)
            first_spec = first_spec or r
    if first_spec is not None:
        out += costs_table(first_spec)
    for name, fn in (("plans", plans), ("peers", peers), ("llama_cpp", llama_cpp), ("sweep", sweep),
                     ("sweep_eagle", functools.partial(sweep, image="sweep_eagle")), ("serve", serve),
                     ("structured", structured), ("startup", startup)):
        if (r := _load(name)) is not None:
            out += fn(r)
    if (runs := _tree_runs()):
        out += trees(runs)
    if (r := _load("verification")) is not None:
        out += verification(r)
    for name, fn in (("quantized_cpu", quantized), ("moe_cpu", moe)):
        if (r := _load(name)) is not None:
            out += fn(r)
    for name in ("mixed_mix", "mixed_edit", "mixed_code"):
        if (r := _load(name)) is not None:
            out += mixed(r, _load("mixed_ceiling_halves"))
    if (r := _load("policy")) is not None:
        from bench.policy import table

        out += table(r)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    page = RESULTS_PAGE.read_text()
    RESULTS_PAGE.write_text(_replace_block(page, START, END, build(), RESULTS_PAGE.name))
    readme = README.read_text()
    README.write_text(_replace_block(readme, HEADLINE_START, HEADLINE_END, headline(), README.name))
    print(f"updated {RESULTS_PAGE} and the headline table of {README}")


if __name__ == "__main__":
    main()
