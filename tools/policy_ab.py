"""The adaptive policy with and without its plain-decoding fixes of 2026-11-26, side by side in one
engine (docs/performance-notes.md, "Plain decoding's own price, and plain probes").

    python tools/policy_ab.py --batch 32 --repeats 8 [--method eagle|draft]

"old" rebuilds the policy before them: plain priced at the verify line's T = 1, no plain probes,
every timing entry smoothed at 0.2. Both run interleaved with plain, K = 1 and K = 2 decoding
(64 new tokens per request, the sweep's prompts and throughput window); ratios are paired per
repeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PLAIN, adaptive, fixed  # noqa: E402
from bench.sweep import run_batch  # noqa: E402
from bench.workloads import load_prompts  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.speculative import costs as costs_module  # noqa: E402
from engine.speculative.policy import Choice  # noqa: E402

NEW_OBSERVE = costs_module.TimingTable.observe


def old_observe(table: costs_module.TimingTable, batch: int, tokens_per_seq: int, seconds: float) -> None:
    """TimingTable.observe before: every observation moves its entry by `smoothing`."""
    row = table._ema[tokens_per_seq]
    b = costs_module.batch_bucket(batch)
    row[b] = costs_module.smoothed(row.get(b), seconds, table.smoothing)
    weights = table._weight[b]
    for t in weights:
        weights[t] *= table.weight_decay
    weights[tokens_per_seq] = weights.get(tokens_per_seq, 0.0) + 1.0


class Switch:
    """Puts one engine's policy into its old or new form between runs."""

    def __init__(self, engine):
        spec = engine.speculation
        self.costs, self.policy = spec.costs, spec.policy
        self.new_verify, self.new_choose = self.costs.verify_times, self.policy.choose
        self.old = False
        self.policy.choose = self._choose

    def _old_verify(self, batch: int, k_max: int) -> list[float]:
        """Every K, plain included, on the weighted line alone (no entry keeps its own figure)."""
        table, ts = self.costs.target, range(1, k_max + 2)
        times = [table.estimate(batch, t) or 1.0 for t in ts]
        return costs_module.line_fit(times, [max(table.weight(batch, t), self.costs.STALE_WEIGHT) for t in ts])

    def _choose(self, *args, **kwargs) -> Choice:
        choice = self.new_choose(*args, **kwargs)
        if self.old and choice.reason == "plain_probe":  # no plain probes: stay where the policy was
            return Choice(self.policy._last_k, "policy", choice.goodput)
        return choice

    def set(self, old: bool) -> None:
        self.old = old
        self.costs.verify_times = self._old_verify if old else self.new_verify
        costs_module.TimingTable.observe = old_observe if old else NEW_OBSERVE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--method", choices=["eagle", "draft"], default="eagle")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(model="embedded:target", draft_model=f"embedded:{'eagle3' if args.method == 'eagle' else 'draft'}",
              use_speculative_decoding=True, speculative_method=args.method, max_batch_size=max(args.batch, 1),
              max_seq_len=1024, enable_prefix_caching=False, max_num_batched_tokens=2048)
    engine = llm.engine
    switch = Switch(engine)
    prompts = (load_prompts("code") + load_prompts("edit"))[:args.batch]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    variants = {"plain": (PLAIN, False), "K=1": (fixed(args.method, 1), False), "K=2": (fixed(args.method, 2), False),
                "adaptive old": (adaptive(args.method), True), "adaptive new": (adaptive(args.method), False)}
    tok_s: dict[str, list[float]] = defaultdict(list)
    k_steps: dict[str, Counter] = defaultdict(Counter)
    for repeat in range(-1, args.repeats):  # repeat -1 warms every variant up, unrecorded
        for name, (cfg, old) in variants.items():
            switch.set(old)
            engine.reconfigure_speculation(**cfg)
            run = run_batch(llm, prompts, params)
            if repeat >= 0:
                tok_s[name].append(run["tok_s"])
                k_steps[name].update(run["k_steps"])
        if repeat >= 0:
            print(f"repeat {repeat}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in tok_s.items()), flush=True)
    print(f"batch {args.batch}, {args.repeats} repeats, {args.method}")
    for name, values in tok_s.items():
        print(f"{name:13s} median {statistics.median(values):6.0f} tok/s, range {min(values):.0f}-{max(values):.0f}; "
              f"steps by K {dict(sorted(k_steps[name].items()))}")
    best = [max(tok_s[n][i] for n in ("plain", "K=1", "K=2")) for i in range(args.repeats)]

    def paired(values: list[float], base: list[float]) -> str:
        ratios = [a / b for a, b in zip(values, base)]
        return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"

    for name in ("adaptive old", "adaptive new"):
        print(f"{name} / best fixed of the same repeat: {paired(tok_s[name], best)}")
    print(f"new / old: {paired(tok_s['adaptive new'], tok_s['adaptive old'])}")


if __name__ == "__main__":
    main()
