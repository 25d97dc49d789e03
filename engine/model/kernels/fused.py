"""A decoder layer's pointwise work in three Triton kernels, for the GPU path (engine/model/fused.py
checks them against the eager ops at load): the residual add with the RMSNorm after it; q and k's
per-head RMSNorm (Qwen3), RoPE, and the KV write into the pool; SiLU of the gate times the up
projection. Each reads its inputs once and writes its outputs once, in the model's dtype,
computing in float32. On CPU they run under Triton's interpreter (TRITON_INTERPRET=1: tests only).
"""

from __future__ import annotations

import functools

import torch

# the compute capability each kernel needs (tools/kernel_compile.py compiles each for its targets)
CAPABILITIES = {"add_rms_norm": (8, 0), "rope_qk_write": (8, 0), "silu_mul": (8, 0)}


@functools.cache
def kernels() -> tuple:
    """The jitted kernels (add_rms_norm, rope_qk_write, silu_mul); triton imported on first use (a
    CPU-only install need not have it)."""
    return _add_rms_norm(), _rope_qk_write(), _silu_mul()


@functools.cache
def _add_rms_norm():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm(x_ptr, residual_ptr, weight_ptr, h_ptr, y_ptr, cols, eps, HAS_RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
        """Row r: h = x + residual (rounded to the storage dtype, as an eager add leaves it), then
        y = h / rms(h) * weight."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * cols + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(residual_ptr + row * cols + offs, mask=mask, other=0.0).to(tl.float32))
            x = x.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * cols + offs, x, mask=mask)
        x = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / cols + eps)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * cols + offs, (x * inv * w).to(y_ptr.dtype.element_ty), mask=mask)

    return add_rms_norm


@functools.cache
def _rope_qk_write():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["heads", "kv_heads", "storage_rows"])  # no code depends on them
    def rope_qk_write(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, norm_ptr, q_ptr, kv_ptr, rows_ptr, heads, kv_heads,
                      storage_rows, eps, HAS_NORM: tl.constexpr, D: tl.constexpr):
        """Token t, head j of q (j < heads) or k (after): its per-head norm (HAS_NORM), RoPE at the
        token's position (rotate-half; sin carries the first half's minus), then q's head to q,
        k's and v's to the pool's layer [2, kv_heads, storage_rows, D] at the token's row."""
        t = tl.program_id(0)
        j = tl.program_id(1)
        offs = tl.arange(0, D)
        width = (heads + 2 * kv_heads) * D
        base = qkv_ptr + t * width + j * D
        x = tl.load(base + offs).to(tl.float32)
        partner = tl.load(base + (offs + D // 2) % D).to(tl.float32)
        if HAS_NORM:
            w = tl.load(norm_ptr + j * D + offs).to(tl.float32)
            x = x / tl.sqrt(tl.sum(x * x, axis=0) / D + eps) * w
            w2 = tl.load(norm_ptr + j * D + (offs + D // 2) % D).to(tl.float32)
            partner = partner / tl.sqrt(tl.sum(partner * partner, axis=0) / D + eps) * w2
        pos = tl.load(positions_ptr + t)
        cos = tl.load(cos_ptr + pos * D + offs).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + offs).to(tl.float32)
        out = x * cos + partner * sin
        if j < heads:
            tl.store(q_ptr + (t * heads + j) * D + offs, out.to(q_ptr.dtype.element_ty))
        else:
            h = j - heads
            row = tl.load(rows_ptr + t)
            tl.store(kv_ptr + (h * storage_rows + row) * D + offs, out.to(kv_ptr.dtype.element_ty))
            v = tl.load(qkv_ptr + t * width + (heads + kv_heads + h) * D + offs)
            tl.store(kv_ptr + ((kv_heads + h) * storage_rows + row) * D + offs, v.to(kv_ptr.dtype.element_ty))

    return rope_qk_write


@functools.cache
def _silu_mul():
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul(gate_up_ptr, out_ptr, cols, BLOCK: tl.constexpr):
        """Row r, a block of columns: silu(gate) * up, gate and up the row's two halves."""
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < cols
        gate = tl.load(gate_up_ptr + row * 2 * cols + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * cols + cols + offs, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * cols + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    return silu_mul


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., C] -> (x + residual, rms_norm(x + residual) * weight), each [..., C]; without
    a residual, (x, rms_norm(x) * weight)."""
    cols = x.shape[-1]
    rows = x.numel() // cols
    h = torch.empty_like(x) if residual is not None else x
    y = torch.empty_like(x)
    block = _pow2(cols)
    # a warp per 256 columns, 4 to 16: a row of 8,192 (Qwen3-32B) over 4 warps took 148 registers in float32
    kernels()[0][(rows,)](x, residual if residual is not None else x, weight, h, y, cols, eps,
                          HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=max(4, min(16, block // 256)))
    return h, y


def rope_qk_write(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  norm: torch.Tensor | None, kv: torch.Tensor, write_rows: torch.Tensor, heads: int, kv_heads: int,
                  eps: float) -> torch.Tensor:
    """qkv [B, T, (heads + 2 kv_heads) D] (contiguous), positions [B, T], cos/sin tables [P, D], norm
    [heads + kv_heads, D] or None, kv one layer's pool storage [2, kv_heads, rows, D], write_rows
    [B * T] -> q [B, T, heads, D] normed and rotated; k (normed, rotated) and v written to the pool."""
    B, T = qkv.shape[:2]
    D = cos.shape[-1]
    q = torch.empty(B, T, heads, D, dtype=qkv.dtype, device=qkv.device)
    kernels()[1][(B * T, heads + kv_heads)](qkv, positions, cos, sin, norm if norm is not None else cos, q, kv,
                                            write_rows, heads, kv_heads, kv.shape[2], eps, HAS_NORM=norm is not None,
                                            D=D)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 I] (gate, then up) -> silu(gate) * up [..., I]."""
    cols = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty(*gate_up.shape[:-1], cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(cols))
    kernels()[2][(rows, -(-cols // block))](gate_up, out, cols, BLOCK=block)
    return out
