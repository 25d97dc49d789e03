"""Triton kernels for the GPU's quantized linears (quant/linear.py): y = x W^T with W read as
stored, never dequantized into memory; W's tile is cast to x's dtype (e4m3 and 4-bit values are
exact in bf16 and fp16) and the sums accumulate in float32 (IEEE: no TF32 for float32 inputs).

- fp8_linear: e4m3 W with one float32 scale per (bn, bk) block; a K tile lies in one scale block
  (the tile divides bk). From sm_89 the tile is converted by the hardware; below, from its bits.
- int4_linear: 4-bit W, eight a 32-bit word along the input, one scale and zero point per group of
  `group` inputs; each word is loaded once and unpacked in registers; a K tile lies in one group.

The grid: column blocks x K splits x row tiles of ROWS. The split count is fixed by (N, K) and
the device's SM count, never by the rows, and the splits' float32 partials are summed in a fixed
order by a second kernel (no atomics): each row's result is the same whatever rows share the
pass. On CPU they run under Triton's interpreter (TRITON_INTERPRET=1: tests only).
"""

from __future__ import annotations

import functools

import torch

ROWS = 16  # rows a program computes (the smallest tl.dot): a pass's rows in tiles of ROWS
# by x's dtype: (output columns a program computes, widest fp8 K tile); float32's dots run on FMA
# units (IEEE), which hold their tiles in registers: narrower tiles, no spills
TILES = {torch.bfloat16: (64, 128), torch.float16: (64, 128), torch.float32: (32, 32)}
WARPS = 8  # with 4, fp8 spills on sm_100 and int4 on sm_86/89 in bf16 (tools/kernel_compile.py)
INT4_BLOCK_K = 128  # an int4 K tile: 16 words a row, so each nibble plane's dot is 16 deep
# the compute capability each kernel needs (tools/kernel_compile.py compiles each for its targets)
CAPABILITIES = {"fp8": (8, 9), "fp8_from_bits": (8, 0), "int4": (8, 0), "split_sum": (8, 0)}
PROGRAMS_PER_SM = 2  # a projection's grid has at least this many programs an SM, where K allows
INTERPRETER_SMS = 4  # the SM count assumed off CUDA (the interpreter), so tests split K too


@functools.cache
def kernels() -> tuple:
    """The jitted kernels (fp8, int4, split_sum); triton imported on first use."""
    return _fp8(), _int4(), _split_sum()


@functools.cache
def _fp8():
    """e4m3 weights with their block scales."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["s_cols", "bn", "bk", "tiles_per_split"])  # no code depends on them
    def fp8(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, s_cols, bn, bk, tiles_per_split, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, NATIVE: tl.constexpr):
        rows = tl.program_id(2) * M_PAD + tl.arange(0, M_PAD)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for t in range(0, tiles_per_split):
            k0 = (split * tiles_per_split + t) * BLOCK_K
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            w_mask = (cols[:, None] < N) & (ks[None, :] < K)
            if NATIVE:  # exact either way: e4m3 fits bf16 and fp16. Through float32: triton 3.6 converts
                # e4m3 -> bf16 by way of f16 with a cvt that needs sm_90 (tools/kernel_compile.py, sm_89)
                w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=w_mask, other=0.0).to(tl.float32).to(x.dtype)
            else:  # e4m3fn bytes (as uint8) -> their values, exactly: sm_80/86 have no e4m3 type
                b = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=w_mask, other=0).to(tl.int32)
                e, m = (b >> 3) & 0xF, b & 7
                normal = (((b & 0x80) << 24) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
                sub = m.to(tl.float32) * 0.001953125  # e == 0: m / 8 x 2^-6
                w = tl.where(e == 0, tl.where((b & 0x80) != 0, -sub, sub), normal).to(x.dtype)
            part = tl.dot(x, tl.trans(w), input_precision="ieee")  # [M_PAD, BLOCK_N]
            scale = tl.load(s_ptr + (cols // bn) * s_cols + k0 // bk, mask=cols < N, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
        out = out_ptr + split * M * N
        tl.store(out + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    return fp8


@functools.cache
def _int4():
    """4-bit weights eight a word, a scale and zero point a group."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["groups", "group", "tiles_per_split"])
    def int4(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, groups, group, tiles_per_split, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, ONE_GROUP: tl.constexpr):
        """A K tile of BLOCK_K inputs is BLOCK_K / 8 words a row, each loaded once; nibble j of
        every word (inputs 8 w + j) is one plane, multiplied by the inputs it stands for: eight
        dots of BLOCK_K / 8 each. ONE_GROUP: the tile lies in one group (its scale a column)."""
        rows = tl.program_id(2) * M_PAD + tl.arange(0, M_PAD)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        words = (K + 7) // 8
        W: tl.constexpr = BLOCK_K // 8
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for t in range(0, tiles_per_split):
            k0 = (split * tiles_per_split + t) * BLOCK_K
            ws = k0 // 8 + tl.arange(0, W)  # [W]
            packed = tl.load(w_ptr + cols[:, None] * words + ws[None, :], mask=(cols[:, None] < N) & (ws[None, :] < words),
                             other=0)  # [BLOCK_N, W]
            if ONE_GROUP:
                g = k0 // group
                scale = tl.load(s_ptr + cols * groups + g, mask=cols < N, other=0.0).to(tl.float32)[:, None]
                zero = tl.load(z_ptr + cols * groups + g, mask=cols < N, other=0).to(tl.float32)[:, None]
            for j in tl.static_range(8):
                ks = ws * 8 + j  # [W]: the inputs plane j stands for
                x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                            other=0.0)  # [M_PAD, W]
                if not ONE_GROUP:
                    at = cols[:, None] * groups + ks[None, :] // group
                    in_range = (cols[:, None] < N) & (ks[None, :] < K)
                    scale = tl.load(s_ptr + at, mask=in_range, other=0.0).to(tl.float32)
                    zero = tl.load(z_ptr + at, mask=in_range, other=0).to(tl.float32)
                w = (((packed >> (4 * j)) & 0xF).to(tl.float32) - zero) * scale  # [BLOCK_N, W]
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
        out = out_ptr + split * M * N
        tl.store(out + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    return int4


@functools.cache
def _split_sum():
    """a K split's float32 partials summed in split order."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["splits"])
    def split_sum(part_ptr, y_ptr, total, splits, BLOCK: tl.constexpr):
        """y = the splits' partials [splits, total] summed in split order."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, splits):
            acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    return split_sum


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits(N: int, K: int, block_n: int, block_k: int, sms: int) -> tuple[int, int]:
    """(splits, K tiles each) for an [N, K] weight: enough splits of whole tiles that the column
    blocks times the splits reach PROGRAMS_PER_SM an SM, where K has the tiles."""
    tiles = -(-K // block_k)
    wanted = -(-PROGRAMS_PER_SM * sms // -(-N // block_n))
    per = -(-tiles // max(1, min(tiles, wanted)))
    return -(-tiles // per), per


def _tile(limit: int, widest: int = 128) -> int:
    """The widest power of two from 16 up to `widest` that divides `limit` (a scale block)."""
    tile = 16
    while tile * 2 <= widest and limit % (tile * 2) == 0:
        tile *= 2
    if limit % tile:
        raise ValueError(f"a scale block of {limit} inputs is not a multiple of 16: no GPU kernel")
    return tile


def launch(kernel, x: torch.Tensor, N: int, block_k: int, weights: tuple, ints: tuple, **constexprs) -> torch.Tensor:
    """Runs `kernel` over x [M, K] -> [M, N] (the weight's tensors, then its ints), its splits
    summed in order where K splits."""
    M, K = x.shape
    block_n = TILES[x.dtype][0]
    count, per = splits(N, K, block_n, block_k, sm_count(x.device))
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = y if count == 1 else torch.empty(count, M, N, dtype=torch.float32, device=x.device)  # [splits, M, N]
    kernel[(-(-N // block_n), count, -(-M // ROWS))](x.contiguous(), *weights, out, M, N, K, *ints, per,
                                                     BLOCK_N=block_n, BLOCK_K=block_k, M_PAD=ROWS, num_warps=WARPS,
                                                     **constexprs)
    if count > 1:
        block = 1024
        kernels()[2][(-(-(M * N) // block),)](out, y, M * N, count, BLOCK=block)
    return y


def fp8_linear(x: torch.Tensor, layer, native: bool = True) -> torch.Tensor:
    """x [M, K] -> [M, N] for an fp8 QuantLinear; native: the e4m3 type (sm_89 on), else from bits."""
    K = x.shape[1]
    bn, bk = layer.block
    widest = TILES[x.dtype][1]
    w = layer.data if native else layer.data.view(torch.uint8)
    return launch(kernels()[0], x, layer.shape[0], min(64, widest) if bk >= K else _tile(bk, widest), (w, layer.scale),
                   (layer.scale.shape[1], bn, bk), NATIVE=native)


def int4_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """x [M, K] -> [M, N] for a 4-bit QuantLinear."""
    if layer.group % 8:
        raise ValueError(f"a group of {layer.group} inputs is not a multiple of 8: no GPU kernel")
    return launch(kernels()[1], x, layer.shape[0], INT4_BLOCK_K, (layer.data, layer.scale, layer.zero),
                   (layer.scale.shape[1], layer.group), ONE_GROUP=layer.group % INT4_BLOCK_K == 0)
