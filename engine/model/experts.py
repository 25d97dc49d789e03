"""A mixture-of-experts MLP (Qwen3-MoE): a router scores each token against E experts, the token
goes through its top k, and their outputs are summed, weighted by the router's softmax (the top k
renormalised where `norm_topk_prob` says so), as transformers' Qwen3MoeSparseMoeBlock computes it.

Terms: a *slot* is one (token, choice) pair, token t's j-th expert at slot t * k + j; experts
compute their slots grouped, never a token at a time:
- CPU: the slots sorted by expert, one matmul per expert that has any (the counts read on the
  host), on weights reordered per expert for oneDNN like the dense ones (each row's result whatever the batch);
- CUDA: the slots sorted by expert into blocks of one expert each, on the device, and one Triton
  kernel per projection over all blocks (kernels/moe.py): static shapes, no host read, so a pass
  captures in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model.kernels import moe as moe_kernels
from engine.model.mlp import Linear, SiluMul, silu_mul


class Experts:
    """One layer's router and experts: its MLP (mlp.py), holding weights of its own."""

    dense = False

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, norm_topk: bool):
        self.router = router  # [E, hidden]
        self.gate_up = gate_up  # [E, 2 I, hidden]: each expert's gate rows, then its up rows
        self.down = down  # [E, hidden, I]
        self.top_k, self.norm_topk = top_k, norm_topk
        self.num_experts = gate_up.shape[0]
        self.shape = (gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2])  # (E, I, hidden)
        self._reordered = None  # CPU: per expert (gate_up, down) in oneDNN's layout
        self._dtype = gate_up.dtype
        self.static = gate_up.device.type == "cuda"  # the device-sorted Triton path (CPU: the host-grouped one)

    def numel(self) -> int:
        experts, inner, hidden = self.shape
        return experts * hidden + 3 * experts * inner * hidden

    @property
    def nbytes(self) -> int:
        """Bytes on the device (the reordered copies, once made, replace the plain ones)."""
        return self.numel() * self._dtype.itemsize

    def prepare(self, dtype: torch.dtype) -> Experts:
        return self

    def weights(self) -> list:
        return [self]

    def reorder(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Re-lays the router and each expert's weights out with `reorder` (CPU: oneDNN's layout)."""
        self.router = reorder(self.router)
        self._reordered = [(reorder(g), reorder(d)) for g, d in zip(self.gate_up, self.down)]
        self.gate_up = self.down = None  # the reordered copies replace them

    def route(self, x: torch.Tensor, linear: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (weights [n, k] in x's dtype, expert ids [n, k])."""
        probs = linear(x, self.router).softmax(dim=-1, dtype=torch.float32)  # [n, E]
        weights, ids = probs.topk(self.top_k, dim=-1)  # [n, k] each
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def __call__(self, x: torch.Tensor, lw, linear: Linear, pass_silu_mul: SiluMul = silu_mul) -> torch.Tensor:
        """The normed input x [B, T, hidden] -> [B, T, hidden] (lw: the layer, whose gate_up and down are None).
        The experts take torch's SiLU-and-multiply, not the pass's (the fused kernel rounds once: other bits)."""
        flat = x.reshape(-1, x.shape[-1])  # [n, hidden]
        weights, ids = self.route(flat, linear)
        if self.static:
            out = moe_kernels.experts(flat, ids, self.gate_up, self.down)  # [n, k, hidden]
        else:
            out = self._grouped(flat, ids, linear)
        return (out * weights[..., None]).sum(dim=1).view_as(x)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, linear: Linear) -> torch.Tensor:
        """CPU: x [n, hidden], ids [n, k] -> each slot's expert output [n, k, hidden]."""
        n, k = ids.shape
        order = ids.flatten().argsort(stable=True)  # [n k]: slots grouped by expert
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()
        rows = x.index_select(0, order // k)  # [n k, hidden]: each slot's token
        out = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if count:
                gate_up, down = self._reordered[e] if self._reordered is not None else (self.gate_up[e], self.down[e])
                out[start:start + count] = linear(silu_mul(linear(rows[start:start + count], gate_up)), down)
                start += count
        return torch.empty_like(out).index_copy_(0, order, out).view(n, k, -1)
