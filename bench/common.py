"""Shared benchmark plumbing: machine record, interleaved repeats, medians, JSON output."""

from __future__ import annotations

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
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from engine.model.llama import compute_dtype, cpu_packs

    bf16 = "float32 (no bf16 kernels)" if compute_dtype(torch.bfloat16, "cpu") == torch.float32 else \
        "bf16" if cpu_packs(torch.bfloat16) else "bf16 (unpacked)"
    return {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_matmul": bf16,  # what a bfloat16 model computes in on this CPU (engine.model.llama.compute_dtype)
            "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def interleave(variants: dict[str, Callable[[], dict]], repeats: int, desc: str) -> dict[str, list[dict]]:
    """Runs A B C A B C ... `repeats` times; each call returns a dict of measurements."""
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    with tqdm(total=repeats * len(variants), desc=desc, unit="run") as bar:
        for _ in range(repeats):
            for name, fn in variants.items():
                runs[name].append(fn())
                bar.update(1)
    return runs


def summarize(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    # the draft's batch-1 steps as token steps is the engine's default, which every command keeps
    # unless its payload says otherwise
    path.write_text(json.dumps({"machine": machine(), "draft_token_step": True, **payload}, indent=2))
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
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="the draft scores only this many of its most frequent tokens (the engine's "
                         "draft_vocab_size; default: the whole vocabulary)")
    from typing import get_args

    from engine.config import DraftQuantization

    ap.add_argument("--draft-quantization", choices=get_args(DraftQuantization), default="int8",
                    help="the draft's narrow passes on int8 weight copies (the engine's draft_quantization)")


def add_batch1_options(ap, repeats: int) -> None:
    """The options of the side-by-side batch-1 comparisons: workload, prompts, repeats."""
    ap.add_argument("--workload", choices=["code", "edit"], default="code")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    ap.set_defaults(repeats=repeats)


PLAIN = {"enabled": False}  # runner.reconfigure() settings: plain decoding


def fixed(method: str, k: int) -> dict:
    """runner.reconfigure() settings: speculation by `method` proposing K = k tokens every step."""
    return {"enabled": True, "method": method, "spec_length": k, "policy": "fixed"}


def adaptive(method: str, k_max: int = 8) -> dict:
    """runner.reconfigure() settings: speculation by `method`, the adaptive policy choosing K
    (0 = plain decoding) up to k_max every step."""
    return {"enabled": True, "method": method, "spec_length": k_max, "policy": "adaptive"}


def ours_variant(llm, spec: dict, prompts: list, params) -> Callable[[], dict]:
    """One benchmark run of our engine: reconfigure speculation, decode the prompts one by one
    (batch 1). Returns tokens/s, the tokens, the acceptance rate (None without drafts) and ms per
    generated token in each engine phase (`generate_each`)."""
    def go() -> dict:
        llm.engine.runner.reconfigure(**spec)
        t0 = time.perf_counter()
        outs, seconds = generate_each(llm, prompts, params)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        drafted = sum(o.num_draft_tokens for o in outs)
        return {"tok_s": tokens / dt, "tokens": [o.token_ids for o in outs],
                "acceptance": sum(o.num_accepted_tokens for o in outs) / drafted if drafted else None,
                "ms_per_token": {k: v / tokens * 1e3 for k, v in seconds.items()}}
    return go


def batch1_llm(target: str, draft: str, vocab_size: int | None, quantization: str = "int8",
               one_sequence_kernels: bool = True, draft_token_step: bool = True):
    """Our engine with both models for batch-1 comparisons (prefix caching off: repeats of the
    same prompt must not get cheaper)."""
    from engine import LLM

    return LLM(model=target, draft_model=draft, use_speculative_decoding=True, max_batch_size=4,
               max_seq_len=1024, enable_prefix_caching=False, draft_vocab_size=vocab_size,
               draft_quantization=quantization, cpu_one_sequence_kernels=one_sequence_kernels,
               cpu_draft_token_step=draft_token_step)


def generate_each(llm, prompts: list, params) -> tuple[list, dict[str, float]]:
    """Generates each prompt alone (batch 1), stepping the engine here to sum where its steps'
    wall time went (engine.metrics.PhaseSeconds). Returns the outputs and seconds per phase."""
    from engine.metrics import PHASES

    eng = llm.engine
    seconds = dict.fromkeys(PHASES, 0.0)
    outs = []
    for prompt in prompts:
        rid = eng.add_request(prompt, params)
        while eng.has_unfinished_requests():
            eng.step()
            for phase, s in eng.last_step_phases.items():
                seconds[phase] += s
        outs.append(eng.get_output(rid))
        eng.release(rid)
    return outs, seconds

