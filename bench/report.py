"""Regenerates the README's results section from bench/results/*.json.

    python -m bench.report          # rewrites the block between the bench markers in README.md
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import RESULTS

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def engine_vs_hf(r: dict) -> list[str]:
    m = r["machine"]
    lines = [f"**Plain decode, our engine vs transformers `generate`** — random-init {r['params_m']}M Llama, "
             f"{r['dtype']}, {r['tokens']} new tokens, {m['cpu']}, {m['threads']} threads, torch {m['torch']} "
             "(`python -m bench.engine_vs_hf`):", "",
             "| batch | ours tok/s | transformers tok/s | ratio |", "| --- | --- | --- | --- |"]
    for b, row in r["results"].items():
        lines.append(f"| {b} | {row['ours']['median']:.0f} | {row['transformers']['median']:.0f} | "
                     f"{row['ratio']:.2f}x |")
    return lines + [""]


def spec(r: dict) -> list[str]:
    m = r["machine"]
    costs = r["costs"]["1"]
    lines = [f"**Speculative decoding on the shipped pair** — workload `{r['workload']}`, {r['prompts']} held-out "
             f"prompts, {r['tokens']} new tokens, temperature {r['temperature']}, batch 1, medians of {r['repeats']} "
             f"interleaved runs; c = {costs['c']:.3f} ({costs['draft_T1']:.2f} ms draft step / "
             f"{costs['target_T1']:.2f} ms target step), {m['cpu']}, {m['threads']} threads "
             f"(`python -m bench.spec_bench --workload {r['workload']}`):", "",
             "| config | tok/s | speedup | acceptance | accepted/round | same tokens as plain | theory (Thm 3.8) | measured ÷ theory |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in r["results"].items():
        acc = f"{e['acceptance']:.3f}" if e["acceptance"] is not None else "-"
        mal = f"{e['mean_accepted_length']:.2f}" if e["mean_accepted_length"] is not None else "-"
        theo = f"{e['theoretical_speedup']:.2f}x" if "theoretical_speedup" in e else "-"
        ratio = f"{e['measured_over_theoretical']:.0%}" if "measured_over_theoretical" in e else "-"
        same = {True: "yes", False: "no", None: "-"}[e["identical_to_plain"]]
        lines.append(f"| {name} | {e['tok_s']['median']:.0f} | {e['speedup']:.2f}x | {acc} | {mal} | {same} | "
                     f"{theo} | {ratio} |")
    return lines + [""]


def costs_table(r: dict) -> list[str]:
    lines = ["**Forward-pass costs** (ms, median; T = tokens per sequence in one target pass):", "",
             "| batch | " + " | ".join(f"T={t}" for t in range(1, 10)) + " | draft step | c |",
             "| --- |" + " --- |" * 11]
    for b, row in r["costs"].items():
        lines.append(f"| {b} | " + " | ".join(f"{row[f'target_T{t}']:.2f}" for t in range(1, 10))
                     + f" | {row['draft_T1']:.2f} | {row['c']:.3f} |")
    return lines + [""]


def build() -> str:
    out: list[str] = []
    if (r := _load("engine_vs_hf")) is not None:
        out += engine_vs_hf(r)
    first_spec = None
    for name in ("spec_code_t0", "spec_edit_t0", "spec_code_t0.8"):
        if (r := _load(name)) is not None:
            out += spec(r)
            first_spec = first_spec or r
    if first_spec is not None:
        out += costs_table(first_spec)
    return "\n".join(out)


def main() -> None:
    text = README.read_text()
    if START not in text:
        raise SystemExit(f"README.md has no {START} marker")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(head + START + "\n" + build() + "\n" + END + tail)
    print("README results updated")


if __name__ == "__main__":
    main()
