"""Greedy speculation against plain decoding in the same engine, on the shipped pair
(docs/speculative/exactness.md): is every output identical, token for token?

    python -m bench exactness [--tokens 64] [--batches 1 8 32] [--pools paged slotted]

For each KV pool and each `batch_invariant` setting (on; off as the comparison, paged only, at
batch 1 and 8, chains), two engines (one started with the EAGLE-3 head, whose methods are eagle,
hybrid, ngram and suffix; one with the draft model) decode 8 code and 4 edit prompts at batch 1 and
8 (24 + 8 at 32), greedy, `ignore_eos`: plain (K = 0), then every proposer under fixed K = 4
chains, adaptive K, width-2 trees and block verification. A cell is identical when every prompt's
tokens equal plain's. Batch invariance: plain's outputs at batch 1 against the same prompts
decoded in batches of 8.
"""

from __future__ import annotations

import torch

from bench.common import PLAIN, adaptive, fixed, host_class, parser, write
from bench.workloads import load_prompts

ENGINE_METHODS = {"eagle": ("eagle", "hybrid", "ngram", "suffix"), "draft": ("draft",)}  # start-up method -> methods
MODES = {"fixed K = 4": lambda m: fixed(m, 4), "adaptive": adaptive,
         "trees (width 2)": lambda m: {**fixed(m, 4), "tree_width": 2},
         "block": lambda m: {**fixed(m, 4), "verification": "block"}}
CHAINS = ("fixed K = 4", "adaptive")  # the modes the rule-off comparison runs


def prompts_for(batch: int) -> list[str]:
    code, edit = (8, 4) if batch <= 8 else (24, 8)
    return load_prompts("code", code) + load_prompts("edit", edit)


def outputs(llm, spec: dict, prompts: list[str], params, batch: int) -> list[list[int]]:
    llm.engine.reconfigure_speculation(**spec)
    return [list(o.token_ids) for i in range(0, len(prompts), batch) for o in llm.generate(prompts[i:i + batch], params)]


def grid(setting: str, pool: str, batches: list[int], modes: tuple[str, ...], params) -> dict:
    """{cell: identical prompts / prompts} for one setting and pool, and the batch-invariance count."""
    from engine import LLM

    cells, alone_in_batch, state = {}, None, None
    for started, methods in ENGINE_METHODS.items():
        llm = LLM(speculative_method=started, batch_invariant=setting, kv_cache_backend=pool,
                  max_batch_size=max(batches), max_seq_len=1024, enable_prefix_caching=False)
        state = llm.engine.stats()["batch_invariant"]
        for batch in batches:
            prompts = prompts_for(batch)
            plain = outputs(llm, PLAIN, prompts, params, batch)
            if batch == 1 and started == "eagle":
                in_eight = outputs(llm, PLAIN, prompts, params, 8)
                alone_in_batch = f"{sum(a == b for a, b in zip(plain, in_eight))}/{len(prompts)}"
            for method in methods:
                for mode in modes:
                    got = outputs(llm, MODES[mode](method), prompts, params, batch)
                    same = sum(a == b for a, b in zip(got, plain))
                    cells[f"{method}, {mode}, batch {batch}"] = f"{same}/{len(prompts)}"
                    print(f"{setting} {pool} {method:7s} {mode:16s} batch {batch:2d}: {same}/{len(prompts)}", flush=True)
        del llm
    return {"batch_invariant": state, "cells": cells, "alone = in a batch of 8": alone_in_batch}


def main(argv: list[str] | None = None) -> None:
    ap = parser("exactness", __doc__, tokens=64, models=False)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--pools", nargs="+", choices=["paged", "slotted"], default=["paged", "slotted"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    runs = {f"on, {pool}": grid("on", pool, args.batches, tuple(MODES), params) for pool in args.pools}
    runs[f"off, {args.pools[0]}"] = grid("off", args.pools[0], [b for b in args.batches if b <= 8], CHAINS, params)
    host = host_class()
    lines = [f"Host: {host}, {args.threads} threads; {args.tokens} greedy tokens", "",
             "| batch_invariant, pool | state | cells identical to plain | alone = in a batch of 8 |",
             "| --- | --- | --- | --- |"]
    for name, r in runs.items():
        whole = sum(c.split("/")[0] == c.split("/")[1] for c in r["cells"].values())
        lines.append(f"| {name} | {r['batch_invariant']} | {whole} of {len(r['cells'])} | {r['alone = in a batch of 8']} |")
    print("\n".join(lines))
    path = write("exactness", {"host": host, "tokens": args.tokens, "runs": runs})
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
