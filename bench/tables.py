"""The results page's parts, each drawn by the bench that writes its results: registered here in
page order as "module:function" under bench (as bench/gpu/check.py registers its sections), with
the formatting they share. bench/report.py assembles the page from them."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from bench.common import RESULTS, host_class
from engine.model.plan import label

IMAGES = "../../bench/results"  # from docs/benchmarks/results.md (the site build copies the plots)
Row = Callable[[str, str, bool], None]  # row(the project's goal, what the results show, met)


@dataclass(frozen=True)
class Part:
    name: str
    target: str  # "module:function" under bench
    results: str | None = None  # the results file it draws (bench/results/<results>.json): function(r)


TABLES = (  # the tables, in page order: function(r) -> list[str] of its results, else page_table()
    Part("engine_vs_hf", "engine_vs_hf:draw", "engine_vs_hf"),
    Part("spec", "spec_bench:page_table"),
    Part("plans", "plans:draw", "plans"),
    Part("peers", "peers:draw", "peers"),
    Part("llama_cpp", "llama_cpp:draw", "llama_cpp"),
    Part("sweep", "sweep:page_table"),
    Part("serve", "serve:draw", "serve"),
    Part("structured", "structured:draw", "structured"),
    Part("startup", "startup:draw", "startup"),
    Part("trees", "trees:page_table"),
    Part("verification", "verification:draw", "verification"),
    Part("quantized", "quantized:draw", "quantized_cpu"),
    Part("moe", "moe:draw", "moe_cpu"),
    Part("mixed", "mixed:page_table"),
    Part("policy", "policy:table", "policy"),
)
TARGETS = (  # the targets table's rows, in its order: each page_targets(row) calls row() per target
    Part("spec", "spec_bench:page_targets"),
    Part("peers", "peers:page_targets"),
    Part("sweep", "sweep:page_targets"),
    Part("serve", "serve:page_targets"),
    Part("structured", "structured:page_targets"),
    Part("plans", "plans:page_targets"),
    Part("trees", "trees:page_targets"),
    Part("verification", "verification:page_targets"),
)


def resolve(part: Part) -> Callable:
    """The part's function; one that draws a results file, bound to it (nothing without the file)."""
    module, function = part.target.split(":")
    fn = getattr(importlib.import_module(f"bench.{module}"), function)
    if part.results is None:
        return fn
    return lambda: [] if (r := load(part.results)) is None else fn(r)


def load(name: str) -> dict | None:
    """bench/results/<name>.json, or None where that bench has not been run."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def host(m: dict) -> str:
    """The host class and the day a result was measured."""
    return f"{host_class(m)}, measured {m['time'][:10]}"


def plan(r: dict) -> str:
    """The forward plan the run's engine used."""
    plans = r.get("forward_plan")
    if not plans:
        return "forward plan not recorded"
    return "forward plan: " + ", ".join(f"{role} {label(p)}" for role, p in plans.items())


def img(name: str) -> list[str]:
    return [f"![{name}]({IMAGES}/{name}.png)", ""] if (RESULTS / f"{name}.png").exists() else []


def spread(d: dict, pooled: bool = True) -> str:
    """A ratio's median [min, max] over repeats, and its pooled value where recorded."""
    out = f"{d['median']:.3f} [{d['min']:.3f}, {d['max']:.3f}]"
    return out + (f" (pooled {d['pooled']:.3f})" if pooled and "pooled" in d else "")


def span(values: dict[str, float]) -> str:
    """"lowest (its name) to highest"."""
    worst = min(values, key=values.get)
    return f"{values[worst]:.3f} ({worst}) to {max(values.values()):.3f}"
