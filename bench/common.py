"""Shared benchmark plumbing: machine record, interleaved repeats, medians, JSON output."""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """The host class next to every figure: CPU model, its vector/matrix flags, threads, torch."""
    from engine.model.plan import host_info

    host = host_info()
    return {"cpu": host["cpu"] or platform.processor(), "cpu_flags": host["flags"],
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def host_class(m: dict | None = None) -> str:
    """One line naming the host of a machine record (default: this one), e.g.
    'Intel(R) Xeon(R) Processor [amx_bf16, avx512_bf16, avx512f, avx2]'."""
    m = m or machine()
    flags = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in m.get("cpu_flags", [])]
    return f"{m['cpu']} [{', '.join(flags) or m.get('cpu_capability', '?')}]"


def interleave(variants: dict[str, Callable[[], dict]], repeats: int, desc: str) -> dict[str, list[dict]]:
    """Runs A B C, C B A, A B C, ... `repeats` times (the order reversed every other repeat, so a
    variant's place in the order, or a host drifting, favours none); each call returns a dict of
    measurements."""
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    with tqdm(total=repeats * len(variants), desc=desc, unit="run") as bar:
        for r in range(repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                runs[name].append(variants[name]())
                bar.update(1)
    return runs


def per_token_alpha(outputs) -> float | None:
    """Leviathan et al.'s per-token acceptance over every round of `outputs` (RequestOutputs):
    accepted ÷ (accepted + rejections), a round ending in a rejection counting one. Not accepted
    ÷ drafted, which counts the proposals after a rejection, never judged, as failures."""
    accepted = rejected = 0
    for o in outputs:
        for a, k in zip(o.accepted_per_round, o.proposed_per_round):
            accepted, rejected = accepted + a, rejected + (a < k)
    return accepted / (accepted + rejected) if accepted + rejected else None


def theoretical(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al., Thm 3.8: speedup of K proposals at per-token acceptance alpha and cost
    ratio c, a verify pass costing verify_cost decode steps (1: the paper's assumption)."""
    if k == 0:
        return 1.0
    tokens = (k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + verify_cost)


def summarize(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def write(name: str, payload: dict, llm=None) -> Path:
    """bench/results/<name>.json: the machine, the forward plan and start-up phases (seconds; a
    warm start reads its caches) of `llm`'s engine (if given) and the payload."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    from engine.model.plan import summary

    plan = {"forward_plan": summary(llm.engine.forward_plan), "startup_s": dict(llm.engine.startup)} \
        if llm is not None else {}
    path.write_text(json.dumps({"machine": machine(), **plan, **payload}, indent=2))
    return path


def parser(command: str, doc: str | None, tokens: int, workloads: bool = False, models: bool = True):
    """The options every benchmark command shares (`python -m bench <command> ...`)."""
    import argparse

    ap = argparse.ArgumentParser(prog=f"python -m bench {command}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if workloads:
        ap.add_argument("--workload", nargs="+", choices=["code", "edit"], default=["code", "edit"])
        ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per workload")
    ap.add_argument("--tokens", type=int, default=tokens, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per variant")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    if models:
        add_model_options(ap)
    return ap


def add_model_options(ap) -> None:
    ap.add_argument("--target", default="embedded:target")
    ap.add_argument("--draft", default="embedded:draft")
    from serve_app.cli import forward_plan_arg

    ap.add_argument("--forward-plan", default="auto", type=forward_plan_arg,
                    help="the engine's forward_plan: auto (measured on this host), torch, or a JSON object")


def add_batch1_options(ap, repeats: int) -> None:
    """The options of the side-by-side batch-1 comparisons: workload, prompts, repeats."""
    ap.add_argument("--workload", choices=["code", "edit"], default="code")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    ap.set_defaults(repeats=repeats)


PLAIN = {"use_speculative_decoding": False}  # reconfigure_speculation() settings: plain decoding


def fixed(method: str, k: int) -> dict:
    """reconfigure_speculation() settings: speculation by `method` proposing K = k tokens every step
    (k_per_request false: after a per-request variant, fixed with it true is an error)."""
    return {"use_speculative_decoding": True, "speculative_method": method, "spec_length": k, "spec_policy": "fixed",
            "k_per_request": False}


def adaptive(method: str, k_max: int = 8) -> dict:
    """reconfigure_speculation() settings: speculation by `method`, the adaptive policy choosing K
    (0 = plain decoding) up to k_max every step."""
    return {"use_speculative_decoding": True, "speculative_method": method, "spec_length": k_max,
            "spec_policy": "adaptive"}


def ours_variant(llm, spec: dict, prompts: list, params) -> Callable[[], dict]:
    """One benchmark run of our engine: reconfigure speculation, decode the prompts one by one
    (batch 1). Returns tokens/s, the tokens, the acceptance rate (None without drafts) and ms per
    generated token in each engine phase (`generate_each`)."""
    def go() -> dict:
        llm.engine.reconfigure_speculation(**spec)
        t0 = time.perf_counter()
        outs, seconds = generate_each(llm, prompts, params)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        drafted = sum(o.num_draft_tokens for o in outs)
        return {"tok_s": tokens / dt, "tokens": [o.token_ids for o in outs],
                "acceptance": sum(o.num_accepted_tokens for o in outs) / drafted if drafted else None,
                "ms_per_token": {k: v / tokens * 1e3 for k, v in seconds.items()}}
    return go


def batch1_llm(target: str, draft: str, forward_plan="auto", max_batch_size: int = 4,
               speculative_method: str = "draft"):
    """Our engine with both models for side-by-side comparisons (prefix caching off: repeats of
    the same prompt must not get cheaper). speculative_method "eagle" when `draft` is an EAGLE-3 head."""
    from engine import LLM

    return LLM(model=target, draft_model=draft, use_speculative_decoding=True, max_batch_size=max_batch_size,
               max_seq_len=1024, enable_prefix_caching=False, forward_plan=forward_plan,
               speculative_method=speculative_method)


class SeparateLearning:
    """Each variant's own learned state (the measured costs the adaptive policy plans K by, the
    shape choice, the tree widths) on an engine that decodes several variants back to back: shared,
    a variant would plan from the others' rounds (a fixed tree variant's slow tree passes priced in
    the table an adaptive chain variant picks K from), which no deployment of it would see."""

    PARTS = ("costs", "shapes", "ranks")  # SpeculativeDecoder attributes holding what it learns

    def __init__(self, llm):
        self.spec = llm.engine.speculation
        self.start = {p: copy.deepcopy(getattr(self.spec, p).__dict__) for p in self.PARTS}  # each variant's first
        self.saved: dict[str, dict] = {}
        self.current: str | None = None

    def switch_to(self, name: str) -> None:
        """The decoder learns as variant `name` from here on (its state as it last left it)."""
        if name == self.current:
            return
        if self.current is not None:
            self.saved[self.current] = {p: getattr(self.spec, p).__dict__ for p in self.PARTS}
        state = self.saved.get(name) or copy.deepcopy(self.start)
        for p in self.PARTS:
            getattr(self.spec, p).__dict__ = state[p]
        self.current = name


def interleave_prompts(llm, specs: dict[str, dict], prompts: list, params: Callable[[int], list], repeats: int,
                       desc: str, switch: Callable[[str, int], None] | None = None,
                       learning: SeparateLearning | None = None) -> dict[str, list[dict]]:
    """Like `interleave`, but finer: within a repeat every prompt is decoded by each variant back to
    back (batch 1; `specs`: reconfigure_speculation() settings by name), the order rotating from
    prompt to prompt, so a shared host's drift falls on the variants alike. params(r): repeat r's
    SamplingParams, one per prompt; switch(name, r), if given, before each variant's decode;
    learning: each variant keeps its own learned state (SeparateLearning; across calls). Per
    variant and repeat: tok/s over its prompts (and their tokens and seconds), decode rounds,
    accepted and verified tokens per round, and the seconds by step phase (engine.request.PHASES)."""
    from engine.request import PHASES

    names = list(specs)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tqdm(total=repeats * len(prompts) * len(names), desc=desc, unit="decode") as bar:
        for r in range(repeats):
            sums = {name: dict.fromkeys(("tokens", "seconds", "rounds", "accepted", "verified"), 0.0) for name in names}
            phases = {name: dict.fromkeys(PHASES, 0.0) for name in names}
            for i, (prompt, p) in enumerate(zip(prompts, params(r), strict=True)):
                turn = (i + r) % len(names)
                for name in names[turn:] + names[:turn]:
                    llm.engine.reconfigure_speculation(**specs[name])
                    if learning is not None:
                        learning.switch_to(name)
                    if switch is not None:
                        switch(name, r)
                    t0 = time.perf_counter()
                    (out,), by_phase = generate_each(llm, [prompt], [p])
                    s = sums[name]
                    for phase, seconds in by_phase.items():
                        phases[name][phase] += seconds
                    s["seconds"] += time.perf_counter() - t0
                    s["tokens"] += len(out.token_ids)
                    s["rounds"] += out.num_spec_rounds
                    s["accepted"] += out.num_accepted_tokens
                    s["verified"] += out.num_draft_tokens
                    bar.update(1)
            for name, s in sums.items():
                rounds = s["rounds"]
                runs[name].append({"tok_s": s["tokens"] / s["seconds"], "tokens": s["tokens"], "seconds": s["seconds"],
                                   "rounds": rounds, "accepted": s["accepted"],
                                   "accepted_per_round": s["accepted"] / rounds if rounds else 0.0,
                                   "verified_per_round": s["verified"] / rounds if rounds else 0.0,
                                   "phases": phases[name]})
    return runs


def pooled(runs: list[dict], numerator: str, denominator: str) -> float:
    """Every run's `numerator` summed ÷ every run's `denominator` summed (e.g. tokens ÷ seconds)."""
    return sum(r[numerator] for r in runs) / sum(r[denominator] for r in runs)


def generate_each(llm, prompts: list, params) -> tuple[list, dict[str, float]]:
    """Generates each prompt alone (batch 1), stepping the engine here to sum where its steps'
    wall time went (engine.request.PhaseSeconds). `params`: one SamplingParams for every prompt,
    or a list of one per prompt. Returns the outputs and seconds per phase."""
    from engine.request import PHASES

    eng = llm.engine
    seconds = dict.fromkeys(PHASES, 0.0)
    outs = []
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    for prompt, prompt_params in zip(prompts, per_prompt, strict=True):
        rid = eng.add_request(prompt, prompt_params)
        while eng.has_unfinished_requests():
            eng.step()
            for phase, s in eng.last_step.phases.items():
                seconds[phase] += s
        outs.append(eng.get_output(rid))
        eng.release(rid)
    return outs, seconds

