"""The engine's Triton kernels against eager torch or the dequantized weight (part of the
`correctness` section), each called through its public wrapper on random inputs:

- fused (kernels/fused.py): add + RMSNorm (with and without a residual), q/k norm + RoPE + the
  KV write (with a per-head norm, Qwen3, and without, Llama), SiLU-and-multiply;
- quantized (kernels/quant.py): `fp8_linear` (128x128 blocks) and `int4_linear` (groups of 128,
  zero points) on a QuantLinear, at 1 and 16 rows, against x W^T with W dequantized;
- MoE (kernels/moe.py): `experts` against a loop over every (token, choice) slot.

Each check records the worst error relative to the reference's largest magnitude; bf16 within
2e-2, float32 within 1e-4 (float32 must be IEEE: TF32 products are off by about 5e-4, so a kernel
whose `tl.dot` lowers to TF32 fails it). On CUDA the matmul kernels run in bf16 and in float32 (a
ValueError or NotImplementedError raised for float32 counts as the refusal the engine may make
instead, recorded as such); on CPU in float32 under Triton's interpreter, and only when it is on
(TRITON_INTERPRET=1, as the test suite sets): otherwise they are skipped, with the reason recorded.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.gpu.context import Context, check

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
REFUSALS = (ValueError, NotImplementedError)  # a float32 path the engine declines, with its message


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def why_skipped(device: str) -> str | None:
    """Why the kernels cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not device.startswith("cuda") and not interpreter_on():
        return "on CPU the Triton kernels run only under Triton's interpreter (TRITON_INTERPRET=1), which is off"
    return None


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want| (elementwise ratios mean nothing near zero)."""
    want = want.float()
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def run(ctx: Context, out: dict) -> None:
    """Every kernel check, recorded in out["kernels"] and as checks; a kernel that raises is
    recorded under its own name and the others still run."""
    results = out["kernels"] = {}
    skipped = why_skipped(ctx.device)
    if skipped is not None:
        out["kernels_skipped"] = skipped
        ctx.log(f"kernel checks skipped: {skipped}")
        return
    cuda = ctx.device.startswith("cuda")
    big = ctx.size(True, False) and cuda  # the real run's shapes on a GPU; toy ones under the interpreter
    fused_dtypes = (torch.bfloat16,) if cuda else (torch.float32,)
    dot_dtypes = (torch.bfloat16, torch.float32) if cuda else (torch.float32,)
    g = torch.Generator(device="cpu").manual_seed(81)
    cases: list[tuple[str, torch.dtype, Callable[[], dict]]] = []
    for dtype in fused_dtypes:
        for residual in (True, False):
            cases.append((f"fused add_rms_norm{'' if residual else ' (no residual)'}", dtype,
                          lambda dtype=dtype, residual=residual: _add_rms_norm(ctx, g, dtype, residual, big)))
        for norm in (False, True):
            cases.append((f"fused rope_qk_write{' with q/k norm' if norm else ''}", dtype,
                          lambda dtype=dtype, norm=norm: _rope_qk_write(ctx, g, dtype, norm, big)))
        cases.append(("fused silu_mul", dtype, lambda dtype=dtype: _silu_mul(ctx, g, dtype, big)))
    for dtype in dot_dtypes:
        cases.append(("fp8_linear", dtype, lambda dtype=dtype: _fp8_linear(ctx, g, dtype, big)))
        cases.append(("int4_linear", dtype, lambda dtype=dtype: _int4_linear(ctx, g, dtype, big)))
        cases.append(("moe experts", dtype, lambda dtype=dtype: _experts(ctx, g, dtype, big)))
    for name, dtype, fn in cases:
        label = f"kernel {name}, {str(dtype).removeprefix('torch.')}"
        tolerance = TOLERANCE[dtype]
        try:
            row = fn()
        except REFUSALS as exc:
            if dtype is torch.float32 and cuda and name in ("fp8_linear", "int4_linear", "moe experts"):
                results[label] = {"refused": f"{type(exc).__name__}: {exc}"}
                check(out, f"{label}: IEEE float32 or refused", True, results[label])
                continue
            row = {"error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # a kernel that does not build or run here, under its own name
            row = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        row["tolerance"] = tolerance
        results[label] = row
        ok = "error" not in row and row["worst"] <= tolerance
        check(out, f"{label} = {'dequantized' if 'linear' in name else 'eager'} within {tolerance:g}", ok, row)
        ctx.log(f"{label}: " + (row["error"] if "error" in row else f"worst relative error {row['worst']:.2e}"))


def _randn(g: torch.Generator, *shape, dtype=torch.float32, device="cpu", scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _add_rms_norm(ctx: Context, g, dtype, residual: bool, big: bool) -> dict:
    from engine.model.kernels import fused

    rows, cols, eps = (16, 4096, 1e-5) if big else (3, 64, 1e-5)
    x = _randn(g, rows, cols, dtype=dtype, device=ctx.device)
    r = _randn(g, rows, cols, dtype=dtype, device=ctx.device) if residual else None
    w = _randn(g, cols, dtype=dtype, device=ctx.device, scale=0.5)
    h, y = fused.add_rms_norm(x, r, w, eps)
    want_h = (x.float() + r.float()).to(dtype) if residual else x
    hf = want_h.float()
    want_y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype)
    return {"shape": [rows, cols], "worst": max(relative_error(h, want_h), relative_error(y, want_y))}


def _rope_qk_write(ctx: Context, g, dtype, norm: bool, big: bool) -> dict:
    """q returned and k, v written into a pool layer's rows, against the same tables applied eagerly."""
    from engine.model.kernels import fused

    B, T, heads, kv_heads, D, P, rows = (4, 4, 32, 8, 128, 256, 64) if big else (2, 3, 4, 2, 16, 32, 12)
    eps, dev = 1e-6, ctx.device
    qkv = _randn(g, B, T, (heads + 2 * kv_heads) * D, dtype=dtype, device=dev)
    positions = torch.randint(0, P, (B, T), generator=g).to(dev)
    angles = torch.rand(P, D // 2, generator=g) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype).to(dev)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype).to(dev)  # the first half's minus folded in
    weight = _randn(g, heads + kv_heads, D, dtype=dtype, device=dev, scale=0.5) if norm else None
    kv = torch.zeros(2, kv_heads, rows, D, dtype=dtype, device=dev)
    write_rows = torch.randperm(rows, generator=g)[:B * T].to(dev)
    q = fused.rope_qk_write(qkv, positions, cos, sin, weight, kv, write_rows, heads, kv_heads, eps)

    x = qkv.float().view(B * T, heads + 2 * kv_heads, D)
    qk = x[:, :heads + kv_heads]
    if norm:
        qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    pos = positions.reshape(-1)
    rotated = qk * cos.float()[pos][:, None] + qk.roll(-(D // 2), dims=-1) * sin.float()[pos][:, None]
    want_q = rotated[:, :heads].to(dtype).view(B, T, heads, D)
    want_kv = torch.zeros_like(kv)
    want_kv[0][:, write_rows] = rotated[:, heads:].to(dtype).transpose(0, 1)
    want_kv[1][:, write_rows] = x[:, heads + kv_heads:].to(dtype).transpose(0, 1)
    return {"shape": [B, T, heads, kv_heads, D], "worst": max(relative_error(q, want_q), relative_error(kv, want_kv))}


def _silu_mul(ctx: Context, g, dtype, big: bool) -> dict:
    from engine.model.kernels import fused

    rows, cols = (16, 14336) if big else (3, 80)
    gate_up = _randn(g, rows, 2 * cols, dtype=dtype, device=ctx.device)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return {"shape": [rows, cols], "worst": relative_error(fused.silu_mul(gate_up), (F.silu(gate) * up).to(dtype))}


def _against_dequantized(ctx: Context, g, dtype, layer, kernel) -> dict:
    """kernel(x, layer) against x W^T, W the layer dequantized, at 1 and 16 rows (a decode pass, a verify pass)."""
    weight = layer.dequantize(torch.float32)
    worst = {}
    for rows in (1, 16):
        x = _randn(g, rows, layer.shape[1], dtype=dtype, device=ctx.device)
        worst[rows] = relative_error(kernel(x, layer), F.linear(x.float(), weight))
    return {"shape": list(layer.shape), "form": layer.form, "by_rows": worst, "worst": max(worst.values())}


def _fp8_linear(ctx: Context, g, dtype, big: bool) -> dict:
    from engine.model.kernels import quant
    from engine.model.quant.linear import QuantLinear

    N, K = (4096, 4096) if big else (192, 256)
    data = _randn(g, N, K, scale=100).clamp(-448, 448).to(torch.float8_e4m3fn).to(ctx.device)
    scale = (torch.rand(-(-N // 128), -(-K // 128), generator=g) / 100 + 1e-3).to(ctx.device)
    layer = QuantLinear("fp8", data, scale, (N, K), block=(128, 128))
    return _against_dequantized(ctx, g, dtype, layer, quant.fp8_linear)


def _int4_linear(ctx: Context, g, dtype, big: bool) -> dict:
    from engine.model.kernels import quant
    from engine.model.quant.linear import QuantLinear, int4_words

    N, K, group = (4096, 4096, 128) if big else (192, 256, 128)
    q = torch.randint(0, 16, (N, K), generator=g)
    scale = (torch.rand(N, K // group, generator=g) / 50 + 1e-3).to(torch.bfloat16)
    zero = torch.randint(0, 16, (N, K // group), generator=g, dtype=torch.uint8)
    layer = QuantLinear("int", int4_words(q).to(ctx.device), scale.to(ctx.device), (N, K), bits=4,
                        zero=zero.to(ctx.device), group=group)
    return _against_dequantized(ctx, g, dtype, layer, quant.int4_linear)


def _experts(ctx: Context, g, dtype, big: bool) -> dict:
    """experts() against each (token, choice) slot computed alone: silu(gate) * up, then down."""
    from engine.model.kernels import moe

    E, hidden, inter, k = (32, 1024, 512, 8) if big else (4, 32, 32, 2)
    dev = ctx.device
    gate_up = _randn(g, E, 2 * inter, hidden, dtype=dtype, device=dev, scale=hidden ** -0.5)
    down = _randn(g, E, hidden, inter, dtype=dtype, device=dev, scale=inter ** -0.5)
    worst = {}
    for n in (1, 16) if big else (1, 3):
        x = _randn(g, n, hidden, dtype=dtype, device=dev)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]).to(dev)
        got = moe.experts(x, ids, gate_up, down)  # [n, k, hidden]
        want = torch.empty(n, k, hidden, dtype=torch.float32, device=dev)
        for i in range(n):
            for j in range(k):
                e = int(ids[i, j])
                gate, up = (gate_up[e].float() @ x[i].float()).chunk(2)
                want[i, j] = down[e].float() @ (F.silu(gate) * up)
        worst[n] = relative_error(got, want)
    return {"shape": [E, hidden, inter, k], "by_tokens": worst, "worst": max(worst.values())}
