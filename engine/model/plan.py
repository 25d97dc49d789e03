"""Which kernels and compute dtype each model's passes use, chosen by measuring on this host.

Candidates: the asked-for dtype and float32 (exact for those weights); a target's one-sequence
kernel, a draft's token steps; only paths that can run here. Each is timed on `SCENARIOS`,
interleaved; the lowest geometric mean of time relative to the fastest wins, cached per (host,
model, torch, dtype, role). On CUDA, or for models too large to hold every candidate: the first
candidate (the asked-for dtype, float32 where oneDNN has no reorder for it), unmeasured (performance-notes).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import ModelPlan
from engine.model.families import family_of, shape_of
from engine.model.kernels import one_sequence
from engine.model.linears import onednn_reorders
from engine.model.loader import load_model, read_config
from engine.model.passes import fill_slots, pool_for, time_pass
from engine.model.quant.schemes import scheme_of
from engine.model.shape import ModelShape
from engine.model.token_step import TOKEN_STEP_ROWS, TokenStep
from engine.model.transformer import Transformer

log = logging.getLogger(__name__)

PLAN_VERSION = 3  # part of the cache key: bump when candidates or measurements change
REPEATS = 5  # timed passes per candidate and shape, each after an untimed one (docs/performance-notes.md#forward-plan)
# per role, the work each candidate is timed on: {scenario: [((sequences, tokens each), passes)]}; a
# target decodes (1 token) and verifies (6: K = 5), a draft catches up on 2 tokens and steps 4 times
SCENARIOS = {"target": {"batch 1": [((1, 1), 1), ((1, 6), 1)], "batch 16": [((16, 1), 1), ((16, 6), 1)]},
             "draft": {"batch 1": [((1, 2), 1), ((1, 1), 4)], "batch 4": [((4, 1), 5)], "batch 16": [((16, 1), 5)]}}
# a plain-only engine's target (use_speculative_decoding false at start-up) is chosen by the decode
# passes it runs, from the same measurements
PLAIN_SCENARIOS = {"batch 1": [((1, 1), 1)], "batch 16": [((16, 1), 1)]}
CONTEXT = 256  # keys each measured sequence attends to (fewer if max positions are fewer)
MEASURE_MEMORY_SHARE = 0.25  # measure only when every candidate's weights fit in this share of RAM


@dataclass(frozen=True)
class PlanChoice:
    """A model's plan and how it was arrived at."""

    plan: ModelPlan
    source: str  # "measured", "cached", "explicit" or "unmeasured"
    ms: dict[str, dict[str, float]] = field(default_factory=dict)  # candidate -> shape -> median ms

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self.plan), "source": self.source, "ms": self.ms}


def label(plan: ModelPlan | dict) -> str:
    """A plan as text, e.g. "float32+token_step" (a ModelPlan, or its dict as stats report it);
    a token step taking passes wider than the default names its width ("+token_step16")."""
    p = plan if isinstance(plan, dict) else dataclasses.asdict(plan)
    rows = p.get("token_step_rows", TOKEN_STEP_ROWS[0])
    names = [n + (str(rows) if n == "token_step" and rows != TOKEN_STEP_ROWS[0] else "")
             for n in ("one_sequence_kernel", "token_step") if p.get(n)]
    return "+".join([p["dtype"], *names])


def candidates(role: str, dtype: str, device: str, shape: ModelShape, quantized: bool = False,
               plain: bool = False) -> list[ModelPlan]:
    """The plans worth measuring for a model of `shape` and `role` asked to run in `dtype` on `device`
    (quantized, or with experts: torch's own passes only; the hand-written kernels read dense layers);
    plain: a plain-only engine's target, which may also take bf16 with the one-sequence kernel (a
    speculative engine's bf16 rule never takes that path: engine/model/invariance.py)."""
    if not device.startswith("cpu"):
        return [ModelPlan(dtype)]
    dtypes = [d for d in dict.fromkeys([dtype, "float32"]) if d == "float32" or onednn_reorders(getattr(torch, d))]
    if quantized or shape.moe is not None:
        return [ModelPlan(d) for d in dtypes]
    runs = {"target": one_sequence.load() is not None,
            "draft": TokenStep.runs(shape) and family_of(shape.model_type).mlp.dense}[role]  # the token step computes SwiGLU itself
    kernel = {"target": "one_sequence_kernel", "draft": "token_step"}[role] if runs else None
    out = []
    # the one-sequence kernel computes in float32 (a plain-only target's bf16 rows in and out); the token step in bf16 too
    for d in dtypes:
        with_kernel = kernel and (d == "float32" or d == "bfloat16" and (kernel == "token_step" or plain))
        widths = [{"token_step_rows": r} for r in TOKEN_STEP_ROWS] if kernel == "token_step" else [{}]  # measured too
        out += [ModelPlan(d)] + ([ModelPlan(d, **{kernel: True}, **w) for w in widths] if with_kernel else [])
    return out


def load_planned(path: Path, role: str, dtype: str, device: str, max_positions: int,
                 explicit: ModelPlan | None = None, plain: bool = False) -> tuple[Transformer, PlanChoice]:
    """The model at `path` loaded with its plan: the explicit one, or the fastest measured (now,
    then cached, or read from the cache); plain: a plain-only engine's target, timed by its decode
    passes alone."""
    if explicit is not None:
        if device == "cpu" and explicit.dtype != "float32" and not onednn_reorders(getattr(torch, explicit.dtype)):
            log.warning("%s: this CPU has no %s matmul kernels; computing in float32", path.name, explicit.dtype)
            explicit = dataclasses.replace(explicit, dtype="float32")
        return load_model(path, explicit, device, max_positions), PlanChoice(explicit, "explicit")
    cfg = read_config(path)
    options = candidates(role, dtype, device, shape_of(cfg), scheme_of(cfg) is not None,
                         plain and role == "target")  # the first: the asked-for dtype
    load = functools.partial(load_model, path, device=device, max_positions=max_positions)
    return _choose(path, role, dtype, device, options, load, max_positions,
                   scenarios=PLAIN_SCENARIOS if plain and role == "target" else None)


def load_planned_head(path: Path, shape: ModelShape, load: Callable[[ModelPlan], Transformer], dtype: str,
                      device: str, max_positions: int,
                      explicit: ModelPlan | None = None) -> tuple[Transformer, PlanChoice]:
    """An EAGLE-3 head of `shape`, computing in its target's `dtype`: its plan only says whether (and
    how wide) its passes take the token step (explicit, or measured as a draft's are)."""
    if explicit is not None:
        plan = dataclasses.replace(explicit, dtype=dtype)
        return load(plan), PlanChoice(plan, "explicit")
    options = [p for p in candidates("draft", dtype, device, shape) if p.dtype == dtype
               and not (p.token_step and shape.num_layers > 1)] or [ModelPlan(dtype)]  # the C step: one layer
    return _choose(path, "draft", dtype, device, options, load, max_positions, cache_role="eagle3")


def _choose(path: Path, role: str, dtype: str, device: str, options: list[ModelPlan],
            load: Callable[[ModelPlan], Transformer], max_positions: int,
            cache_role: str | None = None, scenarios: dict | None = None) -> tuple[Transformer, PlanChoice]:
    """The model loaded with the fastest of `options` for `role` over `scenarios` (default: the
    role's; measured over the role's shapes and cached, so every weighting reads one cache;
    unmeasured when only one option runs or the candidates do not fit in memory together)."""
    if len(options) == 1 or not _fits_in_memory(path, len(options)):
        return load(options[0]), PlanChoice(options[0], "unmeasured")
    cache = cache_file(path, cache_role or role, dtype, device)
    cached = _read_cache(cache)
    by_label = {label(p): p for p in options}
    measured = cached is None or not set(by_label) <= set(cached.ms)
    if measured:
        models = {name: load(p) for name, p in by_label.items()}
        shapes = {shape for passes in SCENARIOS[role].values() for shape, _ in passes}
        ms = measure(models, shapes, max_positions, all_logits=role == "target")
    else:
        ms = {n: cached.ms[n] for n in by_label}
    usual = _fastest(ms, SCENARIOS[role], role, path, "")
    best = usual if scenarios is None else _fastest(ms, scenarios, role, path, " by its decode passes")
    if best != usual:
        log.info("a plain-only engine's target takes %s; a speculative engine's would take %s (an explicit "
                 "forward_plan makes them equal)", best, usual)
    if measured:
        _write_cache(cache, PlanChoice(models[usual].plan, "measured", ms))
        return models[best], PlanChoice(models[best].plan, "measured", ms)
    return load(by_label[best]), dataclasses.replace(cached, plan=by_label[best])


def _fastest(ms: dict[str, dict[str, float]], scenarios: dict, role: str, path: Path, weighed: str) -> str:
    """The label of the candidate with the least relative cost over `scenarios` (logged)."""
    costs = relative_costs(ms, scenarios)
    best = min(costs, key=costs.get)
    log.info("forward plan for %s %s%s: %s (relative cost: %s)", role, path.name, weighed, best,
             {n: round(c, 3) for n, c in costs.items()})
    return best


def relative_costs(ms: dict[str, dict[str, float]], scenarios: dict) -> dict[str, float]:
    """Per candidate, the geometric mean over scenarios of its time / the fastest one's."""
    work = {name: {sc: sum(n * per[f"{b}x{t}"] for (b, t), n in passes) for sc, passes in scenarios.items()}
            for name, per in ms.items()}
    best = {sc: min(w[sc] for w in work.values()) for sc in scenarios}
    return {name: math.exp(statistics.fmean(math.log(w[sc] / best[sc]) for sc in scenarios)) for name, w in work.items()}


def measure(models: dict[str, Transformer], shapes, max_positions: int, all_logits: bool) -> dict[str, dict[str, float]]:
    """Median ms of each model's pass at each (sequences, tokens) shape over CONTEXT keys,
    interleaved across models so slow drifts of the host hit every candidate alike; passes
    return every position's logits (a verify pass) or the last one's (a draft's catch-up)."""
    widest, batch = max(t for _, t in shapes), max(b for b, _ in shapes)
    context = max(1, min(CONTEXT, max_positions - widest))
    pools = {name: pool_for(m, batch, context + widest) for name, m in models.items()}
    slots = {name: fill_slots(m, pools[name], batch, context) for name, m in models.items()}
    times: dict[str, dict[str, list[float]]] = {name: {f"{b}x{t}": [] for b, t in shapes} for name in models}
    for _ in range(REPEATS):
        for name, m in models.items():
            for b, t in shapes:
                args = (m, pools[name], slots[name][:b], t, context, all_logits)
                time_pass(*args)  # warm: another candidate's passes may have evicted its kernels
                times[name][f"{b}x{t}"].append(time_pass(*args))
    return {name: {s: 1e3 * statistics.median(v) for s, v in per.items()} for name, per in times.items()}


def _fits_in_memory(path: Path, copies: int) -> bool:
    weights = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))  # float32 copies are at most 2x
    return 2 * weights * copies <= MEASURE_MEMORY_SHARE * device_memory("cpu")


def device_memory(device: str) -> int:
    """Bytes of memory on `device` (physical RAM on CPU)."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def summary(forward_plan: dict) -> dict:
    """An engine's plan per role without the measurements: {role: {dtype, kernels, source}}."""
    return {role: {k: v for k, v in p.items() if k != "ms"} for role, p in forward_plan.items()}


def cache_dir() -> Path:
    return one_sequence.cache_dir().parent / "plans"


def host_info() -> dict:
    """The host class a plan was measured on: CPU model, its vector and matrix flags, threads."""
    cpu = one_sequence.cpuinfo()
    flags = sorted(f for f in cpu.get("flags", "").split() if f.startswith(("avx", "amx", "fma", "f16c")))
    return {"cpu": cpu.get("model name", ""), "flags": flags, "cpus": os.cpu_count(), "threads": torch.get_num_threads()}


def cache_file(path: Path, role: str, dtype: str, device: str) -> Path:
    """Named by the host, torch, the kernels' build, role, dtype, device and the model (its config and
    weight files)."""
    weights = [(p.name, p.stat().st_size) for p in sorted(Path(path).glob("*.safetensors"))]
    key = {"version": PLAN_VERSION, "host": host_info(), "torch": torch.__version__,
           "kernels": one_sequence.build_digest(), "role": role, "dtype": dtype,
           "device": device, "model": {"config": (Path(path) / "config.json").read_text(), "weights": weights}}
    return cache_dir() / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")


def _read_cache(file: Path) -> PlanChoice | None:
    try:
        data = json.loads(file.read_text())
        return PlanChoice(ModelPlan(**data["plan"]), "cached", data["ms"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(file: Path, choice: PlanChoice) -> None:
    write_cached(file, {"plan": dataclasses.asdict(choice.plan), "ms": choice.ms}, "the forward plan")


def write_cached(file: Path, data: dict, what: str) -> None:
    """`data` as JSON at `file` (a cache_file), written whole or not at all; a warning naming
    `what` where it cannot be (a read-only home only costs a measurement at the next start)."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, file)
    except OSError as exc:
        log.warning("could not cache %s at %s: %s", what, file, exc)
