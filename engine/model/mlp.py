"""A decoder layer's MLP: one object a layer, chosen at load by its family's `read_layer`
(LayerWeights.mlp): `SwiGLU` over the layer's own gate_up and down (every dense family), or a
mixture of experts (experts.py), or a family's own class with the same call.

The call is mlp(x, layer_weights, linear, silu_mul): the normed input [..., hidden] -> [..., hidden],
`layer_weights` its LayerWeights (shape.py), `linear` the pass's matmul (quantized, oneDNN or
the column kernel's), `silu_mul` the pass's SiLU-and-multiply (the fused kernel's where the layer runs fused, else `silu_mul` below), so a
family with its own MLP runs inside the fused path with the fused norms and RoPE around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x, a weight as the plan holds it -> x W^T
SiluMul = Callable[[torch.Tensor], torch.Tensor]  # gate_up [..., 2 I] (gate, then up) -> silu(gate) * up [..., I]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU-and-multiply in torch ops: the fused kernel's contract (kernels/fused.py)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(Protocol):
    """What a layer's MLP offers the forward."""

    dense: bool  # down(silu(gate) * up) over the layer's gate_up and down: the C kernels may compute it themselves

    def __call__(self, x: torch.Tensor, lw, linear: Linear, silu_mul: SiluMul) -> torch.Tensor: ...

    def weights(self) -> list:
        """What it holds beyond the layer's tensors (counted and prepared with the model's)."""

    def reorder(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Its own weights in oneDNN's layout (CPU), as the layer's are."""


class SwiGLU:
    """The dense MLP: down(silu(gate) * up) with the layer's gate_up [2 I, hidden] and down
    [hidden, I]. Holds no weights, so every dense layer shares one."""

    dense = True

    def __call__(self, x: torch.Tensor, lw, linear: Linear, silu_mul: SiluMul = silu_mul) -> torch.Tensor:
        return linear(silu_mul(linear(x, lw.gate_up)), lw.down)

    def weights(self) -> list:
        return []

    def reorder(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Nothing of its own: the layer's gate_up and down are reordered with the layer."""


SWIGLU = SwiGLU()
