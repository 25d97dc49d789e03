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
Target = tuple[str, str, bool]  # (the project's goal, what the results show, met)


@dataclass(frozen=True)
class Part:
    name: str
    target: str  # "module:function" under bench: the lines it draws, none without its results


TABLES = (  # the tables, in page order: each page_table() -> list[str]
    Part("engine_vs_hf", "engine_vs_hf:page_table"),
    Part("spec", "spec_bench:page_table"),
    Part("plans", "plans:page_table"),
    Part("peers", "peers:page_table"),
    Part("llama_cpp", "llama_cpp:page_table"),
    Part("sweep", "sweep:page_table"),
    Part("serve", "serve:page_table"),
    Part("structured", "structured:page_table"),
    Part("startup", "startup:page_table"),
    Part("trees", "trees:page_table"),
    Part("verification", "verification:page_table"),
    Part("quantized", "quantized:page_table"),
    Part("moe", "moe:page_table"),
    Part("mixed", "mixed:page_table"),
    Part("policy", "policy:page_table"),
)
TARGETS = (  # the targets table's rows, in its order: each page_targets() -> list[Target]
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
    module, function = part.target.split(":")
    return getattr(importlib.import_module(f"bench.{module}"), function)


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
