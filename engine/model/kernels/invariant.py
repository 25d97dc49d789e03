"""The CUDA rule of row-count invariance (engine/model/invariance.py) in two Triton kernels: each
row's bits depend on its own inputs only, never on how many rows, tokens or keys share its pass.

- dense_linear: y = x W^T for a dense [N, K] weight on quant.py's grid (column blocks x K splits x
  row tiles of quant.ROWS). Tiles and the split count are fixed by (N, K) and the device, never by
  the rows, and the splits are summed in split order: a row's sums run in one order whatever M.
  cuBLAS picks its kernel (and split-K) by M, so its rows differ between a decode and a verify pass.
- fixed_order_attention: each query token attends over the keys its mask lets it see, visited by
  rank (the token's visible keys in key order, compacted on the device), in blocks of BLOCK_KEYS,
  with an online softmax in float32 (flash attention's arithmetic: q k^T and p v as dots, p in
  the K/V dtype). Masked keys are never loaded, and a block holds the same ranks whatever the
  token's pass: a verify row, its decode step and a tree node over scattered keys compute the same
  sums. No KV splits: one program a (sequence, KV head, query token), its query heads the rows.
On CPU they run under Triton's interpreter (TRITON_INTERPRET=1: tests only).
"""

from __future__ import annotations

import functools

import torch

from engine.model.kernels import quant

# keys a program scores at once, by the K/V dtype (float32's dots run on FMA units, holding their
# tiles in registers: 64 spilled at head_dim 128 on sm_80, tools/kernel_compile.py)
BLOCK_KEYS = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}
ATTENTION_WARPS = 8  # 4 spilled in bf16 at head_dim 64 on sm_100
# the compute capability each kernel needs (tools/kernel_compile.py compiles each for its targets)
CAPABILITIES = {"dense": (8, 0), "attention": (8, 0)}


@functools.cache
def kernels() -> tuple:
    """The jitted kernels (dense, attention); triton imported on first use."""
    return _dense(), _attention()


@functools.cache
def _dense():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["tiles_per_split"])
    def dense(x_ptr, w_ptr, out_ptr, M, N, K, tiles_per_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              M_PAD: tl.constexpr):
        """Rows of a tile of M_PAD x one column block x one K split: its float32 partial sums."""
        rows = tl.program_id(2) * M_PAD + tl.arange(0, M_PAD)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for t in range(0, tiles_per_split):
            ks = (split * tiles_per_split + t) * BLOCK_K + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")  # [M_PAD, BLOCK_N]
        out = out_ptr + split * M * N
        tl.store(out + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    return dense


@functools.cache
def _attention():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "L"])
    def attention(q_ptr, k_ptr, v_ptr, order_ptr, count_ptr, out_ptr, Hkv, T, L, scale, sq_b, sq_h, sq_t,
                  sk_h, sk_b, sk_l, sv_h, sv_b, sv_l, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                  BLOCK: tl.constexpr):
        """Query token t of sequence b, the G query heads of KV head kv (rows of a G_PAD tile, each
        key and value loaded once for them): softmax(q k^T * scale) v over the token's visible keys,
        order_ptr [B, T, L] their indices in key order (the first count_ptr[b, t] of them)."""
        bk = tl.program_id(0)
        t = tl.program_id(1)
        b = bk // Hkv
        kv = bk % Hkv
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = kv * G + g
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + t * sq_t + d[None, :], mask=(g < G)[:, None],
                    other=0.0)  # [G_PAD, D]
        row = (b * T + t).to(tl.int64)
        count = tl.load(count_ptr + row)
        m = tl.full((G_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((G_PAD,), dtype=tl.float32)
        acc = tl.zeros((G_PAD, D), dtype=tl.float32)
        for start in range(0, count, BLOCK):
            ranks = start + tl.arange(0, BLOCK)
            seen = ranks < count
            key = tl.load(order_ptr + row * L + ranks, mask=seen, other=0).to(tl.int64)  # [BLOCK]
            k = tl.load(k_ptr + kv * sk_h + b * sk_b + key[:, None] * sk_l + d[None, :], mask=seen[:, None],
                        other=0.0)  # [BLOCK, D]
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, BLOCK]
            s = tl.where(seen[None, :], s, float("-inf"))
            new_m = tl.maximum(m, tl.max(s, axis=1))  # finite: the block holds a visible key
            p = tl.exp(s - new_m[:, None])
            alpha = tl.exp(m - new_m)
            v = tl.load(v_ptr + kv * sv_h + b * sv_b + key[:, None] * sv_l + d[None, :], mask=seen[:, None],
                        other=0.0)  # [BLOCK, D]
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m = new_m
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a token that sees no key: zeros
        tl.store(out_ptr + ((b * Hkv * G + heads[:, None]) * T + t) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(g < G)[:, None])

    return attention


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> x W^T [..., N] for a dense weight [N, K] (contiguous), each row's sums in one
    order whatever the rows (quant.launch's grid: fixed tiles and K splits)."""
    if weight.dim() != 2 or weight.layout != torch.strided:
        raise ValueError(f"batch_invariant's CUDA rule multiplies dense [N, K] weights, not {weight.layout} "
                         f"{tuple(weight.shape)}")
    N, K = weight.shape
    block_k = quant.TILES[x.dtype][1] // 2 if x.dtype != torch.float32 else quant.TILES[x.dtype][1]
    y = quant.launch(kernels()[0], x.reshape(-1, K), N, block_k, (weight.contiguous(),), ())
    return y.view(*x.shape[:-1], N)


def fixed_order_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """q [B, heads, T, D], k/v [kv_heads, B, L, D] (any strides along heads, sequences and keys),
    mask [B, 1, T, L] bool (None: every key) -> [B, heads, T, D] in q's dtype; attention.attend's
    contract, each row over its visible keys in key order."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[0], k.shape[2]
    if D & (D - 1) or D < 16:
        raise ValueError(f"batch_invariant's CUDA attention takes head_dim a power of two from 16, not {D}")
    if k.stride(3) != 1 or v.stride(3) != 1:
        k, v = k.contiguous(), v.contiguous()
    q = q if q.stride(3) == 1 else q.contiguous()
    if mask is None:
        order = torch.arange(L, dtype=torch.int32, device=q.device).expand(B, T, L).contiguous()  # [B, T, L]
        count = torch.full((B, T), L, dtype=torch.int32, device=q.device)
    else:
        seen = mask[:, 0].expand(B, T, L)  # [B, T, L]
        count = seen.sum(-1, dtype=torch.int32)  # [B, T]
        order = torch.argsort((~seen).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # visible keys first
    out = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    G = H // Hkv
    kernels()[1][(B * Hkv, T)](q, k, v, order, count, out, Hkv, T, L, scale, q.stride(0), q.stride(1), q.stride(2),
                               k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), G=G,
                               G_PAD=max(16, 1 << (G - 1).bit_length()), D=D, BLOCK=BLOCK_KEYS[k.dtype],
                               num_warps=ATTENTION_WARPS)
    return out
