"""A packed verify pass against the same pass padded (engine/model/packing.py): the shipped
target, a batch of which half the rows verify K + 1 tokens and half one, over 256 keys each, with
a uniform pass of K + 1 tokens a row and a plain one beside; interleaved, medians.

    python -m bench packing [--repeats 15]
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import host_class, machine, parser, write

SHAPES = ((8, 5), (16, 5), (32, 3), (64, 3))  # (rows, K of the proposing half)
CONTEXT = 256


def measure(llm, batch: int, k: int, repeats: int) -> dict[str, float]:
    """Median ms of each pass: packed, padded (packing off), uniform K, plain."""
    from engine.model import packing
    from engine.model.passes import fill_slots, forward_chunks

    model, pool = llm.engine.model, llm.engine.kv.target
    slots = fill_slots(model, pool, batch, CONTEXT)
    ragged = [[7] * (k + 1) if i % 2 == 0 else [7] for i in range(batch)]
    passes = {"packed": ragged, "padded": ragged, "uniform K": [[7] * (k + 1)] * batch, "plain": [[7]] * batch}
    times: dict[str, list[float]] = {name: [] for name in passes}
    below = packing.PACK_BELOW
    try:
        for _ in range(repeats):
            for name, chunks in passes.items():
                packing.PACK_BELOW = 0.0 if name == "padded" else below
                t0 = time.perf_counter()
                forward_chunks(model, pool, slots, chunks, [CONTEXT] * batch, all_logits=name != "plain")
                times[name].append(time.perf_counter() - t0)
                for s in slots:
                    pool.truncate_to(s, CONTEXT)
    finally:
        packing.PACK_BELOW = below
        for s in slots:
            pool.free_slot(s)
    return {name: 1e3 * statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = parser("packing", __doc__, tokens=0)
    ap.set_defaults(repeats=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import LLM

    llm = LLM(model=args.target, forward_plan=args.forward_plan, max_batch_size=64, max_seq_len=1024,
              enable_prefix_caching=False)
    results = {}
    for batch, k in SHAPES:
        ms = results[f"{batch}x{k}"] = measure(llm, batch, k, args.repeats)
        ms["padded_over_packed"] = ms["padded"] / ms["packed"]
        print(f"batch {batch}, half the rows at K = {k}: " + ", ".join(f"{n} {v:.2f} ms" for n, v in ms.items()
                                                                      if n != "padded_over_packed")
              + f"; padded ÷ packed {ms['padded_over_packed']:.2f}")
    print(f"host: {host_class(machine())}")
    print(f"wrote {write('packing', {'repeats': args.repeats, 'context': CONTEXT, 'results': results}, llm)}")


if __name__ == "__main__":
    main()
