"""The experts of a mixture-of-experts layer on CUDA (moe.py), with static shapes and no host read:
the slots (token, choice) sorted by expert on the device into blocks of BLOCK_M slots that share
one expert (each expert's run padded to whole blocks), then one Triton kernel per projection
computes every block against its expert's weight, read in place. Blocks past the used ones exit
at once, so a pass's grid is fixed by its token count alone and captures in a CUDA graph.
On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1: tests only).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK_M = 16  # slots a program computes (the smallest tl.dot)
CAPABILITIES = {"grouped": (8, 0)}  # the compute capability each kernel needs (tools/kernel_compile.py)


@functools.cache
def kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["S"])  # the slots in use: new every pass, no code depends on it
    def grouped(x_ptr, w_ptr, slots_ptr, experts_ptr, y_ptr, S, N, K, x_div, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        b = tl.program_id(0)
        e = tl.load(experts_ptr + b).to(tl.int64)
        if e >= 0:  # a block in use
            slot = tl.load(slots_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
            used = slot < S
            row = slot // x_div  # the input row a slot reads (its token, or the slot itself)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + row[:, None] * K + ks[None, :], mask=used[:, None] & (ks[None, :] < K), other=0.0)
                w = tl.load(w_ptr + e * N * K + cols[:, None] * K + ks[None, :],
                            mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")  # float32: no TF32
            tl.store(y_ptr + slot[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=used[:, None] & (cols[None, :] < N))

    return grouped


def sorted_blocks(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [n, k] -> (slots [blocks x BLOCK_M]: slot numbers grouped by expert, n k where unused;
    the expert of each block [blocks], -1 past the used ones). blocks = ceil((n k + E (BLOCK_M - 1)) / BLOCK_M)."""
    flat = ids.flatten()  # [S]
    S, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E]
    ends = padded.cumsum(0)  # [E]: where each expert's blocks end
    order = flat.argsort(stable=True)  # [S]
    expert = flat[order]  # [S]
    rank = torch.arange(S, device=device) - (counts.cumsum(0) - counts)[expert]  # a slot's place in its expert's run
    blocks = -(-(S + num_experts * (BLOCK_M - 1)) // BLOCK_M)
    slots = torch.full((blocks * BLOCK_M,), S, dtype=torch.int64, device=device)
    slots[(ends - padded)[expert] + rank] = order
    starts = torch.arange(blocks, device=device) * BLOCK_M  # [blocks]
    block_expert = torch.searchsorted(ends, starts, right=True)
    return slots, torch.where(starts < ends[-1], block_expert, -1)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, block_expert: torch.Tensor,
                   num_slots: int, x_div: int) -> torch.Tensor:
    """Each slot s's row x[s // x_div] times its block's expert weight [E, N, K] -> [num_slots, N]."""
    N, K = weight.shape[1:]
    y = torch.empty(num_slots, N, dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 64
    grid = (block_expert.numel(), -(-N // block_n))
    kernel()[grid](x.contiguous(), weight, slots, block_expert, y, num_slots, N, K, x_div, BLOCK_M=BLOCK_M,
                   BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def experts(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [n, hidden], ids [n, k], gate_up [E, 2 I, hidden], down [E, hidden, I] -> each slot's
    expert output [n, k, hidden]."""
    n, k = ids.shape
    slots, block_expert = sorted_blocks(ids, gate_up.shape[0])
    gate, up = grouped_linear(x, gate_up, slots, block_expert, n * k, x_div=k).chunk(2, dim=-1)  # [n k, I] each
    return grouped_linear(F.silu(gate) * up, down, slots, block_expert, n * k, x_div=1).view(n, k, -1)
