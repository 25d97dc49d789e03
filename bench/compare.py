"""Before/after of a change: the default engine of two source trees, run in alternating processes.

    git worktree add /tmp/before <rev>
    python -m bench compare --before /tmp/before --after . --repeats 3 [--temperature 0.8] [--method eagle]

Each process loads one tree's engine on the embedded target (`LLM(...)`, batch up to 16) with its
draft model, or with --method eagle its EAGLE-3 head, and times plain decoding,
K = 5 and the adaptive model proposer, hybrid and n-gram settings at batch 1
(4 code prompts one at a time, 96 tokens) and batch 16 (16 prompts together, 64 tokens); the
trees alternate, so the host's drift hits both. Prints after / before per setting (median and
range of the per-repeat ratios) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def spec(method: str, k: int, policy: str) -> dict:
    return {"use_speculative_decoding": True, "speculative_method": method, "spec_length": k, "spec_policy": policy}


def settings_of(method: str) -> dict[str, dict]:
    """Plain, K = 5 and adaptive by the model proposer `method`, hybrid and n-gram adaptive."""
    return {"plain": {"use_speculative_decoding": False}, f"{method} K=5": spec(method, 5, "fixed"),
            f"{method} adaptive": spec(method, 8, "adaptive"), "hybrid adaptive": spec("hybrid", 8, "adaptive"),
            "ngram adaptive": spec("ngram", 8, "adaptive")}


def run_tree(tree: str, temperature: float = 0.0, method: str = "draft") -> dict[str, float]:
    """tok/s of every setting at batch 1 and 16 in this process, on `tree`'s engine."""
    sys.path.insert(0, tree)
    import torch

    torch.set_num_threads(2)
    from bench.workloads import load_prompts
    from engine import LLM, SamplingParams

    head = {"draft_model": "embedded:eagle3", "speculative_method": "eagle"} if method == "eagle" \
        else {"draft_model": "embedded:draft", "speculative_method": "draft"}
    llm = LLM(max_batch_size=16, max_seq_len=1024, enable_prefix_caching=False, **head)
    engine = llm.engine
    tok = engine.tokenizer
    b1 = [tok.encode(p) for p in load_prompts("code", 4)]
    b16 = [tok.encode(p) for p in (load_prompts("code") + load_prompts("edit"))[:16]]
    out = {}
    for name, settings in settings_of(method).items():
        if hasattr(engine, "reconfigure_speculation"):
            engine.reconfigure_speculation(**settings)
        else:  # trees from before SpecConfig
            engine.runner.reconfigure(enabled=settings["use_speculative_decoding"],
                                      method=settings.get("speculative_method"),
                                      spec_length=settings.get("spec_length"), policy=settings.get("spec_policy"))
        for batch, prompts, n in ((1, b1, 96), (16, b16, 64)):
            params = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=7)
            groups = [[p] for p in prompts] if batch == 1 else [prompts]
            for warm_up in (True, False):
                t0 = time.perf_counter()
                tokens = sum(len(o.token_ids) for g in groups for o in llm.generate(g, params))
                if not warm_up:
                    out[f"batch {batch}, {name}"] = tokens / (time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="source tree of the 'before' engine")
    ap.add_argument("--after", required=True, help="source tree of the 'after' engine")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="before_after.json")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled (seeded)")
    ap.add_argument("--method", choices=["draft", "eagle"], default="draft",
                    help="the model proposer: the embedded draft model, or the embedded EAGLE-3 head")
    ap.add_argument("--one-tree", help=argparse.SUPPRESS)  # internal: run one tree, print JSON
    args = ap.parse_args(argv)
    if args.one_tree:  # run as a script in a child process: its own folder must not shadow the tree's modules
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
        print(json.dumps(run_tree(args.one_tree, args.temperature, args.method)))
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from serve_app.kernel_caches import bound_kernel_caches

    bound_kernel_caches()  # both trees under the serving bound (inherited by the processes), as bench runs
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for rep in range(args.repeats):
        for name, tree in trees.items():
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--before", "-", "--after", "-",
                                   "--one-tree", tree, "--temperature", str(args.temperature), "--method", args.method], capture_output=True, text=True, cwd="/", check=True)
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(rep, name, {k: round(v) for k, v in runs[name][-1].items()}, flush=True)
    result = {}
    for key in runs["before"][0]:
        ratios = [a[key] / b[key] for a, b in zip(runs["after"], runs["before"])]
        result[key] = {"before": statistics.median(r[key] for r in runs["before"]),
                       "after": statistics.median(r[key] for r in runs["after"]),
                       "after_over_before": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        print(f"{key:28s} after / before {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    with open(args.out, "w") as f:
        json.dump({"runs": runs, "result": result}, f, indent=1)


if __name__ == "__main__":
    main()
