"""How often the adaptive policy takes a tree at batch 1, and at what rate each shape's rounds ran.

    python tools/shape_choice_log.py [--method eagle] [--width 2] [--nodes 8] [--temperature 0.0] [--repeats 4]

Held-out code prompts one at a time, adaptive K with tree_width 1 (chains only) and then with
trees, `--repeats` times in turn; per run: tok/s, and from the shape choice's own observations the
tree and chain rounds it took and their tokens per second, its probes' estimate of tree ÷ chain
(shape_choice.py), and the trees' acceptance by sibling rank (tree_width.py: how often a node's
r-th child was the one accepted).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: bench, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="eagle", choices=["ngram", "suffix", "eagle", "draft", "hybrid"])
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from bench.common import adaptive, generate_each
    from bench.workloads import load_prompts
    from engine import LLM, SamplingParams
    from engine.speculative.policy import shape_choice

    rounds: list[tuple[bool, int, float]] = []  # (tree?, tokens, seconds) of each observed round
    observe = shape_choice.ShapeChoice.observe

    def recording(self, sampled, batch, tree, tokens, seconds):
        rounds.append((tree, tokens, seconds))
        observe(self, sampled, batch, tree, tokens, seconds)

    shape_choice.ShapeChoice.observe = recording
    prompts = load_prompts("code")[:args.prompts]
    model = {"draft_model": "embedded:draft"} if args.method == "draft" else {}
    llm = LLM(speculative_method=args.method, max_batch_size=1, max_seq_len=1024, enable_prefix_caching=False,
              tree_tokens=args.nodes, **model)
    for repeat in range(args.repeats):
        speeds = {}
        for width in (1, args.width):
            llm.engine.reconfigure_speculation(**adaptive(args.method), tree_width=width)
            params = [SamplingParams(temperature=args.temperature, max_tokens=96, ignore_eos=True, seed=100 * repeat + i)
                      for i in range(len(prompts))]
            rounds.clear()
            t0 = time.perf_counter()
            outs, _ = generate_each(llm, prompts, params)
            speeds[width] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
            if width > 1:
                trees = [r for r in rounds if r[0]]
                chains = [r for r in rounds if not r[0]]
                hits = llm.engine.speculation.ranks.hit_rates(args.temperature > 0)[:args.width]
                probed = llm.engine.speculation.shapes.tree_over_chain(args.temperature > 0, 1)
                print(f"repeat {repeat}: chains only {speeds[1]:.1f} tok/s, with trees {speeds[width]:.1f} "
                      f"(x{speeds[width] / speeds[1]:.3f}); tree rounds {len(trees)} at {_rate(trees):.0f} tok/s, "
                      f"chain rounds {len(chains)} at {_rate(chains):.0f} tok/s; probes' tree ÷ chain "
                      f"{'-' if probed is None else f'{probed:.2f}'}; hits by sibling rank "
                      + ", ".join("-" if h is None else f"{h:.2f}" for h in hits), flush=True)


def _rate(rounds: list[tuple[bool, int, float]]) -> float:
    seconds = sum(s for _, _, s in rounds)
    return sum(t for _, t, _ in rounds) / seconds if seconds else 0.0


if __name__ == "__main__":
    main()
