"""The target's one-sequence passes on the row kernel as it was before column_blocks.c (one weight
row at a time, built from git revision --before, by default the last before it) against the
column-block kernel, in one process: plain decoding, eagle K = 5 and eagle adaptive at batch 1
(code prompts one at a time), the two kernels alternating run by run, the order reversed every
other repeat.

    python tools/column_blocks_ab.py --repeats 8 [--temperature 0.8] [--prompts 16] [--tokens 96]
    python tools/column_blocks_ab.py --matmuls --repeats 31   # the target's matmuls alone, by rows

Prints new ÷ old per setting (paired medians and ranges), each setting's speed-up over plain
decoding with each kernel, and (greedy) whether every speculative text equals plain decoding's.
Needs a C compiler and the repository's git history.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.workloads import load_prompts  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model.kernels import one_sequence  # noqa: E402
from engine.model.transformer import MATMULS, LayerWeights, OneSequencePath, Transformer  # noqa: E402

PLAN = {"target": {"dtype": "float32", "one_sequence_kernel": True},
        "draft": {"dtype": "float32", "token_step": True, "token_step_rows": 16}}


def build_row_kernel(revision: str, out: Path):
    """The row kernel of `revision` (whose one_sequence_* took a `streamed` flag), as a linear(x, w)."""
    for name in ("one_sequence.c", "token_step.c"):
        source = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:engine/model/kernels/{name}"],
                                check=True, capture_output=True, text=True).stdout
        (out / name).write_text(source)
    lib_path = out / "rows.so"
    compiler = os.environ.get("CC") or "cc"
    subprocess.run([compiler, *one_sequence.FLAGS, str(out / "one_sequence.c"), str(out / "token_step.c"), "-o",
                    str(lib_path), "-lm"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    fns = {torch.bfloat16: lib.one_sequence_bf16, torch.float32: lib.one_sequence_f32}
    for fn in fns.values():
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int]

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out_features, in_features = w.shape
        rows = x.reshape(-1, in_features).to(torch.float32).contiguous()  # [M, in]
        y = torch.empty(rows.shape[0], out_features)  # [M, out]
        fns[w.dtype](w.data_ptr(), rows.data_ptr(), y.data_ptr(), out_features, in_features, rows.shape[0], 1,
                     torch.get_num_threads())  # streamed = 1: one weight row at a time
        return y.view(*x.shape[:-1], out_features)
    linear.fns = fns
    return linear


def unpack(weight: one_sequence.ColumnBlocks) -> torch.Tensor:
    """The [out, in] weight back from its column blocks."""
    blocks = weight.blocks  # [blocks, in, 16]
    if blocks.dtype == torch.bfloat16:
        order = [c for j in range(8) for c in (j, j + 8)]
        blocks = blocks[..., sorted(range(16), key=order.__getitem__)]
    return blocks.transpose(1, 2).reshape(-1, blocks.shape[1])[:weight.out_features].contiguous()


def time_matmuls(old: OneSequencePath, new: OneSequencePath, row_fns: dict, repeats: int) -> None:
    """The target's matmuls of one pass (direct calls, no Python wrapper) on each kernel, alternated,
    at 1-9 rows: new ÷ old, paired medians and ranges."""
    kernels, threads = one_sequence.load(), torch.get_num_threads()
    pairs = [(getattr(o, n), getattr(c, n)) for o, c in zip(old.layers, new.layers) for n in MATMULS]
    pairs.append((old.lm_head, new.lm_head))
    for rows in (1, 2, 3, 4, 6, 7, 9):
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _ in pairs}  # [rows, in] per input width
        ys = {c.blocks.shape[0]: torch.empty(rows, c.blocks.shape[0] * 16) for _, c in pairs}  # [rows, out]

        def run_old(rows=rows, xs=xs, ys=ys):
            for w, c in pairs:
                row_fns[w.dtype](w.data_ptr(), xs[w.shape[1]].data_ptr(), ys[c.blocks.shape[0]].data_ptr(), w.shape[0],
                                 w.shape[1], rows, 1, threads)

        def run_new(rows=rows, xs=xs, ys=ys):
            for _, c in pairs:
                fn = kernels.column_bf16 if c.blocks.dtype == torch.bfloat16 else kernels.column_f32
                fn(c.blocks.data_ptr(), xs[c.blocks.shape[1]].data_ptr(), ys[c.blocks.shape[0]].data_ptr(),
                   c.blocks.shape[0] * 16, c.blocks.shape[1], rows, threads)
        times = {"old": [], "new": []}
        for r in range(repeats):
            for name, fn in ((("old", run_old), ("new", run_new)) if r % 2 else (("new", run_new), ("old", run_old))):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        ratio = [n / o for n, o in zip(times["new"], times["old"])]
        print(f"{rows} rows, {len(pairs)} matmuls: row kernel {statistics.median(times['old']) * 1e3:.2f} ms, column "
              f"blocks {statistics.median(times['new']) * 1e3:.2f} ms; new ÷ old {statistics.median(ratio):.3f} "
              f"({min(ratio):.2f}-{max(ratio):.2f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="c393de7~1", help="git revision whose row kernel is the baseline (default: the "
                    "last one before column_blocks.c)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--matmuls", action="store_true", help="time the target's matmuls alone instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        row_linear = build_row_kernel(args.before, Path(tmp))

        def on_rows(path: OneSequencePath) -> OneSequencePath:
            """The same weights unpacked, on the row kernel."""
            layers = [LayerWeights(**{**vars(lw), **{n: unpack(getattr(lw, n)) for n in MATMULS}}) for lw in path.layers]
            return path._replace(layers=layers, kernel=row_linear, lm_head=unpack(path.lm_head))

        def paths(llm: LLM) -> dict:
            new = llm.engine.model._one_sequence
            if new is None:
                raise SystemExit("the target's plan does not take the one-sequence kernel here")
            return {"new": new, "old": on_rows(new)}

        common = {"max_batch_size": 1, "enable_prefix_caching": False, "forward_plan": PLAN}
        if args.matmuls:
            new = paths(LLM(use_speculative_decoding=False, **common))
            return time_matmuls(new["old"], new["new"], row_linear.fns, args.repeats)
        shared = {"plain": LLM(use_speculative_decoding=False, **common),
                  "K=5": LLM(speculative_method="eagle", spec_policy="fixed", spec_length=5, **common)}
        swap = {name: paths(llm) for name, llm in shared.items()}
        # one adaptive engine per kernel, each built on its kernel: the policy's start-up
        # calibration times that kernel's passes
        adaptive = {"new": LLM(speculative_method="eagle", spec_policy="adaptive", spec_length=8, **common)}
        packed_path = Transformer._one_sequence_path
        Transformer._one_sequence_path = lambda model: on_rows(packed_path(model))
        try:
            adaptive["old"] = LLM(speculative_method="eagle", spec_policy="adaptive", spec_length=8, **common)
        finally:
            Transformer._one_sequence_path = packed_path

        def engine(setting: str, kernel: str) -> LLM:
            if setting == "adaptive":
                return adaptive[kernel]
            shared[setting].engine.model._one_sequence = swap[setting][kernel]
            return shared[setting]

        prompts = load_prompts("code", args.prompts)
        variants = [(s, k) for s in ("plain", "K=5", "adaptive") for k in ("old", "new")]
        for v in variants:  # warm-up
            engine(*v).generate(prompts[:2], SamplingParams(temperature=args.temperature, max_tokens=32, seed=0))
        rates = {v: [] for v in variants}
        texts = {v: [] for v in variants}
        for r in range(args.repeats):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                llm, tokens, outs = engine(*v), 0, []
                t0 = time.perf_counter()
                for i, p in enumerate(prompts):
                    o = llm.generate([p], SamplingParams(temperature=args.temperature, max_tokens=args.tokens,
                                                         ignore_eos=True, seed=1000 * r + i))[0]
                    tokens += len(o.token_ids)
                    outs.append(o.token_ids)
                rates[v].append(tokens / (time.perf_counter() - t0))
                texts[v].append(outs)
            print(f"repeat {r}: " + ", ".join(f"{s}/{k} {rates[(s, k)][-1]:.0f}" for s, k in variants) + " tok/s",
                  flush=True)
    for s in ("plain", "K=5", "adaptive"):
        ratio = [n / o for n, o in zip(rates[(s, "new")], rates[(s, "old")])]
        print(f"{s}: new ÷ old {statistics.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f}); medians "
              f"{statistics.median(rates[(s, 'old')]):.0f} -> {statistics.median(rates[(s, 'new')]):.0f} tok/s")
    for k in ("old", "new"):
        for s in ("K=5", "adaptive"):
            up = [a / b for a, b in zip(rates[(s, k)], rates[("plain", k)])]
            print(f"{k} kernel: eagle {s} ÷ plain {statistics.median(up):.3f} ({min(up):.2f}-{max(up):.2f})")
    if args.temperature == 0:
        for k in ("old", "new"):
            same = all(a == b for s in ("K=5", "adaptive") for run, plain in zip(texts[(s, k)], texts[("plain", k)])
                       for a, b in zip(run, plain))
            print(f"{k} kernel: greedy speculative texts equal plain decoding's: {same}")


if __name__ == "__main__":
    main()
