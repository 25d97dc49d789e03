"""A packed pass: of a [B, T] pass whose rows are padded to the longest, the linears (projections,
MLP, LM head) compute only the real tokens, [N] of them; attention, RoPE and the K/V write keep the
padded [B, T] layout (they read per row). A verify pass whose rows propose different K then costs
by the batch's total tokens, not B x the widest row (docs/speculative/per-request.md).
"""

from __future__ import annotations

import torch

PACK_BELOW = 0.85  # pack when the real tokens are at most this share of the padded pass's


class Packing:
    """The real tokens of a [B, T] pass: `index` [N], their flat positions in B * T."""

    def __init__(self, index: torch.Tensor, batch: int, width: int):
        self.index, self.batch, self.width = index, batch, width

    @property
    def tokens(self) -> int:
        return self.index.shape[0]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C] -> [N, C]: the real tokens."""
        return x.reshape(self.batch * self.width, -1).index_select(0, self.index)

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] -> [B, T, C]: the real tokens in place, zeros in the padding."""
        out = x.new_zeros(self.batch * self.width, x.shape[-1])
        return out.index_copy_(0, self.index, x).view(self.batch, self.width, -1)


def packed_positions(lengths: list[int], width: int) -> list[int] | None:
    """Flat positions (row * width + column) of the real tokens of rows of `lengths` padded to
    `width`, or None where packing saves too little (PACK_BELOW) or there is one row."""
    total = sum(lengths)
    if len(lengths) < 2 or total > PACK_BELOW * len(lengths) * width:
        return None
    return [b * width + j for b, n in enumerate(lengths) for j in range(n)]
