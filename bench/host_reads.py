"""Counts the tensor reads back to the host in each decode step (what would each be a host-device
sync on a GPU): Tensor.tolist / item / cpu / numpy / bool / int / float, during engine.step(),
for plain and speculative decoding at batch 1 and 16, greedy and sampled. Runs on any tree, so a
change's before and after can be compared:

    python -m bench host-reads [--tree DIR]      # DIR: a checkout (default: this one)

The shipped pair with forward_plan "torch" (the CPU-only kernels read their inputs on the host by
design and never run on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench host-reads", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    sys.path.insert(0, args.tree)
    import torch

    from engine import LLM, SamplingParams

    calls = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **kw):
            calls[0] += 1
            return _original(self, *a, **kw)

        setattr(torch.Tensor, name, counted)
    llm = LLM(forward_plan="torch", spec_policy="fixed", spec_length=4, max_batch_size=16, enable_prefix_caching=False)
    engine = llm.engine
    prompts = ["def fibonacci(n):\n", "class Stack:\n", "import os\n\n\ndef main():\n", "x = [i * i for i in"]
    for spec in (False, True):
        engine.reconfigure_speculation(use_speculative_decoding=spec)
        for batch in (1, 16):
            for temperature in (0.0, 0.8):
                params = SamplingParams(temperature=temperature, max_tokens=200, ignore_eos=True, seed=1)
                ids = [engine.add_request(prompts[i % 4], params) for i in range(batch)]
                while any(not engine.request(r).output_token_ids for r in ids):
                    engine.step()
                counts = []
                for _ in range(args.steps):
                    before = calls[0]
                    engine.step()
                    counts.append(calls[0] - before)
                for r in ids:
                    engine.abort(r)
                    engine.release(r)
                print(f"{'speculative K=4' if spec else 'plain':16s} batch {batch:2d} temperature {temperature}: "
                      f"host reads per decode step median {statistics.median(counts):.0f} "
                      f"(min {min(counts)}, max {max(counts)})", flush=True)


if __name__ == "__main__":
    main()
