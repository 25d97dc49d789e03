"""PNG plots from bench/results/*.json (whichever exist), written next to them.

    python -m bench plots
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import RESULTS


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_phases(ax, r: dict) -> None:
    """Milliseconds per generated token by engine phase, stacked, for plain and each method's
    adaptive and fastest fixed K."""
    res = r["results"]
    names = ["plain"]
    for m in sorted({n.split("/")[0] for n in res if "/" in n}):
        fixed = [n for n in res if n.startswith(f"{m}/K=")]
        if fixed:
            names.append(max(fixed, key=lambda n: res[n]["speedup"]))
        if f"{m}/adaptive" in res:
            names.append(f"{m}/adaptive")
    names = [n for n in names if "ms_per_token" in res.get(n, {})]
    left = [0.0] * len(names)
    for phase, color in (("target", "C0"), ("draft", "C1"), ("prefill", "C2"), ("other", "C7")):
        widths = [res[n]["ms_per_token"][phase] for n in names]
        ax.barh(names, widths, left=left, color=color, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per generated token")
    ax.set_title("where the time goes")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="x")


def plot_spec(r: dict, out: Path) -> None:
    """Speedup over plain by K, one line per method, adaptive as a marker; theory for the draft;
    beside it, where the time per token goes (when the results carry phase times)."""
    plt = _plt()
    with_phases = "ms_per_token" in r["results"].get("plain", {})
    fig, axes = plt.subplots(1, 2 if with_phases else 1, figsize=(12 if with_phases else 7, 4.2),
                             gridspec_kw={"width_ratios": [1.4, 1]} if with_phases else None)
    ax = axes[0] if with_phases else axes
    if with_phases:
        _plot_phases(axes[1], r)
    methods = sorted({name.split("/")[0] for name in r["results"] if "/" in name})
    for i, m in enumerate(methods):
        ks = sorted(int(n.split("=")[1]) for n in r["results"] if n.startswith(f"{m}/K="))
        color = f"C{i}"
        ax.plot(ks, [r["results"][f"{m}/K={k}"]["speedup"] for k in ks], "o-", color=color, label=f"{m} fixed K")
        if f"{m}/adaptive" in r["results"]:
            ax.axhline(r["results"][f"{m}/adaptive"]["speedup"], color=color, ls="--", lw=1,
                       label=f"{m} adaptive")
        theo = [r["results"][f"{m}/K={k}"].get("theoretical_speedup") for k in ks]
        if all(t is not None for t in theo):
            ax.plot(ks, theo, ":", color=color, label=f"{m} theory (Thm 3.8)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("K (proposed tokens per round)")
    ax.set_ylabel("speedup over plain decode")
    ax.set_title(f"workload {r['workload']}, temperature {r['temperature']}, batch 1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_sweep(r: dict, out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    batches = [int(b) for b in r["results"]]
    for name in r["variants"]:
        ax.plot(batches, [r["results"][str(b)][name]["tok_s"]["median"] for b in batches], "o-", label=name,
                lw=2.5 if "adaptive" in name else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("batch sweep: plain vs fixed-K vs adaptive\n(greedy, code + edit prompts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_peers(r: dict, out: Path) -> None:
    plt = _plt()
    workloads = list(r["workloads"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        rows = r["workloads"][w]["results"]
        names = list(rows)
        values = [rows[n]["tok_s"]["median"] for n in names]
        colors = ["C0" if n.startswith("ours") else "C7" for n in names]
        ax.barh(names, values, color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (batch 1, greedy)")
        ax.set_title(f"{w} workload, same weights")
        ax.grid(alpha=0.3, axis="x")
        ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_serve(r: dict, out: Path) -> None:
    """Output tokens/s, TTFT p50 and inter-token latency p50 against concurrency, one line per mode."""
    plt = _plt()
    levels = list(r["results"])
    names = list(r["results"][levels[0]]["modes"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, name in enumerate(names):
        style = dict(marker="o", color="C7" if name.startswith("plain") else "C3" if name.startswith("adaptive")
                     else f"C{i}", ls="--" if name.endswith("in-process") else "-",
                     lw=2.2 if name.startswith("adaptive") else 1.2)
        for ax, key in zip(axes, ("tok_s", "ttft_ms", "itl_ms")):
            vals = [r["results"][lv]["modes"][name][key] for lv in levels]
            ax.plot([int(lv) for lv in levels], [v["p50"] if isinstance(v, dict) else v for v in vals],
                    label=name, **style)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "inter-token latency p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams (guidellm)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"serving sweep, {r['host']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    made = []
    for name, fn in (("spec_code_t0", plot_spec), ("spec_edit_t0", plot_spec), ("spec_code_t0.8", plot_spec),
                     ("sweep", plot_sweep), ("sweep_eagle", plot_sweep), ("peers", plot_peers), ("serve", plot_serve)):
        r = _load(name)
        if r is not None:
            out = RESULTS / f"{name}.png"
            fn(r, out)
            made.append(out.name)
    print("plots: " + (", ".join(made) if made else "no results yet"))


if __name__ == "__main__":
    main()
