"""How a layer's x W^T runs: oneDNN's reordered-weight matmul on CPU (where it can reorder the dtype),
and the dispatch that lets quantized linears (quant/linear.py) run themselves."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def reordered_linear(x: torch.Tensor, reordered_weight: torch.Tensor) -> torch.Tensor:
    """x W^T with a weight reordered by oneDNN (torch.ops.mkldnn._reorder_linear_weight)."""
    return torch.ops.mkldnn._linear_pointwise(x, reordered_weight, None, "none", [], "")


def any_linear(base: Callable, quantized: bool) -> Callable:
    """x, weight -> x W^T: `base`, or where some weights are quantized linears (quant/linear.py),
    which run themselves, a dispatch on the weight (kept off dense models' decode loop)."""
    if not quantized:
        return base

    def linear(x: torch.Tensor, weight) -> torch.Tensor:
        return base(x, weight) if isinstance(weight, torch.Tensor) else weight(x)
    return linear


def at_least_rows(linear: Callable, widths: frozenset[int]) -> Callable:
    """`linear` with a pass of a single row whose width is in `widths` run as two copies of it (row-count
    invariance, engine/model/invariance.py: oneDNN's one-row kernel sums in another order at some widths)."""
    if not widths:
        return linear

    def padded(x: torch.Tensor, weight) -> torch.Tensor:
        if x.numel() != x.shape[-1] or x.shape[-1] not in widths:  # more than one row, or a width that agrees
            return linear(x, weight)
        y = linear(x.reshape(1, -1).expand(2, -1).contiguous(), weight)  # [2, out]
        return y[:1].reshape(*x.shape[:-1], y.shape[-1])
    return padded


@functools.cache
def onednn_reorders(dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder `dtype` matmul weights on this CPU (probed once on a tiny tensor).
    float32 reorders wherever oneDNN runs; bf16 needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True
