"""Prefill padding: how long chunks are padded before a pass (engine/model/passes.py), measured.

    python -m bench prefill [--lengths 40] [--repeats 3]

Pads a prompt chunk of T > 16 tokens to the next power of two (up to 1.9x the work), to the next
multiple of 32 or 64, or not at all; each policy prefills the same prompts of random lengths in
17..512 (one request at a time, batch 1, the target of the shipped pair; a first pass over each
length untimed is not taken: new shapes pay their one-off cost as they would in service) and is
timed per prompt token. Policies interleaved; medians with ranges.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from bench.common import interleave, parser, write
from engine.kv.protocol import power_of_two_at_least

POLICIES = {
    "power of two": power_of_two_at_least,
    "multiple of 64": lambda t: -(-t // 64) * 64,
    "multiple of 32": lambda t: -(-t // 32) * 32,
    "exact": lambda t: t,
}


def main(argv: list[str] | None = None) -> None:
    ap = parser("prefill", __doc__, tokens=1)
    ap.add_argument("--lengths", type=int, default=40, help="prompts (random lengths 17..512) per run")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import engine.model.passes as passes
    from engine import LLM, SamplingParams

    llm = LLM(model=args.target, forward_plan=args.forward_plan, max_batch_size=1, max_seq_len=1024,
              enable_prefix_caching=False, max_num_batched_tokens=1024)
    vocab = llm.engine.model.shape.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1)
    unpadded = passes.UNPADDED_MAX

    def variant(pad, seed):
        def go() -> dict:
            rng = random.Random(seed)
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(17, 512))] for _ in range(args.lengths)]
            passes.padded_length = lambda t: t if t <= unpadded else pad(t)
            t0 = time.perf_counter()
            for p in prompts:
                llm.generate([p], params)
            seconds = time.perf_counter() - t0
            return {"us_per_token": 1e6 * seconds / sum(map(len, prompts)),
                    "shapes": len({pad(len(p)) for p in prompts})}
        return go

    runs = interleave({name: variant(pad, 0) for name, pad in POLICIES.items()}, args.repeats, "prefill padding")
    results = {}
    base = statistics.median(r["us_per_token"] for r in runs["power of two"])
    for name, rs in runs.items():
        us = [r["us_per_token"] for r in rs]
        results[name] = {"us_per_token": {"median": statistics.median(us), "min": min(us), "max": max(us)},
                         "vs_power_of_two": statistics.median(us) / base, "shapes": rs[0]["shapes"]}
        print(f"{name:15s} {statistics.median(us):7.1f} us/token ({min(us):.1f}-{max(us):.1f}), "
              f"{statistics.median(us) / base:.3f} of power-of-two, {rs[0]['shapes']} shapes")
    print(f"wrote {write('prefill', {'lengths': args.lengths, 'repeats': args.repeats, 'results': results}, llm)}")


if __name__ == "__main__":
    main()
