"""Triton kernels for the GPU's quantized linears (quant/linear.py) at decode and verify widths (at
most 16 rows): y = x W^T with W read as stored, never dequantized into memory; W's tile is cast to
x's dtype (bf16 on a GPU: e4m3 exactly) for the tensor cores, the sums accumulate in fp32.

- fp8_linear: e4m3 W with one float32 scale per (bn, bk) block; a K tile lies in one scale block
  (the tile divides bk), so the tile's products are summed, then scaled once per output row.
- int4_linear: 4-bit W packed eight a word along the input, one scale and zero point per group of
  `group` inputs; a K tile lies in one group.
On CPU they run under Triton's interpreter (TRITON_INTERPRET=1: tests only).
"""

from __future__ import annotations

import functools

import torch

ROWS = 16  # the rows a program computes: a pass's, padded


@functools.cache
def kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, s_cols, bn, bk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            M_PAD: tl.constexpr):
        n0 = tl.program_id(0) * BLOCK_N
        rows = tl.arange(0, M_PAD)
        cols = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
            part = tl.dot(x, tl.trans(w.to(x.dtype)))  # [M_PAD, BLOCK_N]: e4m3 is exact in bf16
            scale = tl.load(s_ptr + (cols // bn) * s_cols + k0 // bk, mask=cols < N, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def int4(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, groups, group, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             M_PAD: tl.constexpr):
        n0 = tl.program_id(0) * BLOCK_N
        rows = tl.arange(0, M_PAD)
        cols = n0 + tl.arange(0, BLOCK_N)
        words = (K + 7) // 8
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            packed = tl.load(w_ptr + cols[:, None] * words + ks[None, :] // 8, mask=(cols[:, None] < N) & (ks[None, :] < K),
                             other=0)
            q = ((packed >> ((ks[None, :] % 8) * 4)) & 0xF).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            g = k0 // group
            scale = tl.load(s_ptr + cols * groups + g, mask=cols < N, other=0.0).to(tl.float32)  # [BLOCK_N]
            zero = tl.load(z_ptr + cols * groups + g, mask=cols < N, other=0).to(tl.float32)
            w = (q - zero[:, None]) * scale[:, None]
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    return fp8, int4


def _tile(limit: int) -> int:
    """The widest power of two from 16 up to 128 that divides `limit` (a scale block or a group)."""
    tile = 16
    while tile * 2 <= 128 and limit % (tile * 2) == 0:
        tile *= 2
    if limit % tile:
        raise ValueError(f"a scale block or group of {limit} inputs is not a multiple of 16: no GPU kernel")
    return tile


def fp8_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """x [M, K] (M <= 16) -> [M, N] for an fp8 QuantLinear."""
    M, K = x.shape
    N = layer.shape[0]
    bn, bk = layer.block
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_n = 64
    kernels()[0][(-(-N // block_n),)](x.contiguous(), layer.data, layer.scale, y, M, N, K, layer.scale.shape[1], bn,
                                      bk, BLOCK_N=block_n, BLOCK_K=64 if bk >= K else _tile(bk), M_PAD=ROWS)
    return y


def int4_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """x [M, K] (M <= 16) -> [M, N] for a 4-bit QuantLinear."""
    M, K = x.shape
    N = layer.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_n = 64
    kernels()[1][(-(-N // block_n),)](x.contiguous(), layer.data, layer.scale, layer.zero, y, M, N, K,
                                      layer.scale.shape[1], layer.group, BLOCK_N=block_n, BLOCK_K=_tile(layer.group),
                                      M_PAD=ROWS)
    return y
