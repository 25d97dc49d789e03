"""Regenerates the benchmark tables from bench/results/*.json.

    python -m bench report   # rewrites docs/benchmarks/results.md (between its bench markers) and
                             # the README's headline table (between its headline markers)

Each table and each target row is drawn by the bench that writes its results, registered in
bench/tables.py; this module assembles the page and the README's headline.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import host_class
from bench.tables import TABLES, TARGETS, load, resolve

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS_PAGE = ROOT / "docs" / "benchmarks" / "results.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
HEADLINE_START, HEADLINE_END = "<!-- headline:start -->", "<!-- headline:end -->"


def _replace_block(text: str, start: str, end: str, body: str, name: str = "the page") -> str:
    if start not in text or end not in text:
        raise SystemExit(f"{name} lacks the {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + "\n" + body + "\n" + end + tail


def summary() -> str:
    """The project's targets next to what the committed results show (each bench's rows)."""
    rows: list[str] = []

    def row(target: str, measured: str, met: bool) -> None:
        rows.append(f"| {target} | {measured} | {'yes' if met else '**no**'} |")

    for part in TARGETS:
        resolve(part)(row)
    if not rows:
        return ""
    return "\n".join(["**Targets** (the project's goals, from the results below):", "", "| target | measured | met |",
                      "| --- | --- | --- |", *rows, ""])


def _short(m: dict) -> str:
    return f"{host_class(m)}, {m['time'][:10]}"


def headline() -> str:
    """Five figures for the README, each with its host and date."""
    rows = []
    if (r := load("spec_code_t0")) is not None:
        name = next((n for n in ("hybrid-eagle/adaptive", "hybrid/adaptive") if n in r["results"]), None)
        if name:
            what = {"hybrid-eagle/adaptive": "prompt lookup, else the EAGLE-3 head (hybrid), adaptive",
                    "hybrid/adaptive": "prompt lookup, else the draft model (hybrid), adaptive"}[name]
            rows.append((f"code completion, batch 1, greedy: {what}, vs plain decoding",
                         f"{r['results'][name]['speedup']:.2f}x", _short(r["machine"])))
    if (r := load("spec_edit_t0")) is not None and "ngram/adaptive" in r["results"]:
        rows.append(("editing, batch 1, greedy: n-gram prompt lookup, adaptive, vs plain decoding",
                     f"{r['results']['ngram/adaptive']['speedup']:.2f}x", _short(r["machine"])))
    if (r := load("serve")) is not None:
        if "1" in r["results"]:
            rows.append(("served over HTTP, one stream: adaptive vs plain decoding",
                         f"{r['results']['1']['adaptive_over_plain']:.2f}x", _short(r["machine"])))
        ratios = [row["adaptive_over_best"] for row in r["results"].values()]
        levels = list(r["results"])
        rows.append((f"served over HTTP, {levels[0]} to {levels[-1]} streams: adaptive ÷ the best of plain and "
                     "every fixed K at each load", f"{min(ratios):.3f} to {max(ratios):.3f}", _short(r["machine"])))
    if (r := load("peers")) is not None and "code" in r["workloads"]:
        e = r["workloads"]["code"]["results"]["ours draft (adaptive)"]
        rows.append(("vs transformers assisted generation with the same draft model, batch 1, code",
                     f"{e['vs_transformers_assisted']:.2f}x", _short(r["machine"])))
    return "\n".join(["| measured | figure | host, date |", "| --- | --- | --- |",
                      *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def build() -> str:
    out = [targets] if (targets := summary()) else []
    for part in TABLES:
        out += resolve(part)()
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    page = RESULTS_PAGE.read_text()
    RESULTS_PAGE.write_text(_replace_block(page, START, END, build(), RESULTS_PAGE.name))
    readme = README.read_text()
    README.write_text(_replace_block(readme, HEADLINE_START, HEADLINE_END, headline(), README.name))
    print(f"updated {RESULTS_PAGE} and the headline table of {README}")


if __name__ == "__main__":
    main()
