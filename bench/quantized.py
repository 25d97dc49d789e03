"""Weight-only quantization on CPU: plain batch-1 decoding of a Qwen3-0.6B-shaped random model
stored bf16, INT8 (compressed-tensors W8A16, per channel: torch's int8 kernel) and INT4 (W4A16,
groups of 128: torch's int4 kernel), interleaved; the step, bf16 ÷ each, and the bytes of the
layers' linears and of the whole model (the tied 151,936-row embedding stays bf16 in all three).

    python -m bench quantized [--repeats 5] [--tokens 32]

Writes bench/results/quantized_cpu.json. The same comparison on a GPU (FP8, INT4, the 8B shape)
is `python -m bench gpu --sections quantized`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench import tables
from bench.common import host_class, machine, write
from bench.gpu.context import Context
from bench.gpu.quantized import compare

QWEN3_0_6B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                  intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                  tie_word_embeddings=True, hidden_act="silu", attention_bias=False, use_sliding_window=False,
                  sliding_window=None, max_window_layers=28)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench quantized", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        ctx = Context(device="cpu", smoke=False, work=Path(work))
        rows = compare(ctx, QWEN3_0_6B, ("int8", "int4"), args.tokens, args.repeats, "qwen3_0_6b")
    host = host_class(machine())
    for layout, r in rows.items():
        line = f"{layout}: step {r['step_ms']['median']:.1f} ms ({r['step_ms']['min']:.1f}-{r['step_ms']['max']:.1f})"
        if layout != "bf16":
            line += (f", bf16 ÷ this {r['bf16_step_over_this']:.2f}x; linears {r['linear_bytes_over_bf16']:.3f} of "
                     f"bf16's bytes, whole model {r['bytes_over_bf16']:.3f}")
        print(line)
    print(f"host: {host}")
    print(f"wrote {write('quantized_cpu', {'shape': 'Qwen3-0.6B', 'repeats': args.repeats, 'formats': rows})}")


def draw(r: dict) -> list[str]:
    rows = r["formats"]
    lines = [f"**Weight-only quantization** — a {r['shape']}-shaped random model, plain batch-1 decoding, "
             f"{r['repeats']} interleaved repeats (the first dropped), median step [range]; {tables.host(r['machine'])} "
             "(`python -m bench quantized`). Bytes: the layers' linears with scales and zero points ÷ bf16's, "
             "then the whole model (the embedding stays bf16).", "",
             "| format | step, ms | bf16 ÷ this | linears' bytes ÷ bf16 | whole model |", "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        step = row["step_ms"]
        ratio = f"{row['bf16_step_over_this']:.2f}x" if name != "bf16" else "1"
        lines.append(f"| {row['format']} | {step['median']:.1f} [{step['min']:.1f}, {step['max']:.1f}] | {ratio} | "
                     f"{row.get('linear_bytes_over_bf16', 1.0):.3f} | {row.get('bytes_over_bf16', 1.0):.3f} |")
    return lines + [""]

