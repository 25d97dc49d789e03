"""Int8 weight-only matmuls for a draft model's passes over a few rows.

A draft step on CPU costs what its weights cost to read; int8 copies (one scale per output
channel, symmetric) are a quarter of float32's bytes (docs/performance-notes.md#int8-draft).
Only a draft may use this: its proposals change how many tokens are accepted, never which.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


class Int8Weight(NamedTuple):
    q: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] bfloat16: w[o, i] ~ q[o, i] * scales[o]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """weight [out, in] (any float dtype) -> per-output-channel symmetric int8 copy."""
    w = weight.float()
    # the scales are rounded to bfloat16 (the kernel's dtype) before quantizing with them, so
    # each weight is within half a step of the scale the kernel multiplies by
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(torch.bfloat16)  # [out]
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)  # [out, in]
    return Int8Weight(q.contiguous(), scales)


def int8_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x [..., in] @ dequantized(weight).T -> [..., out] in x's dtype; the product runs on
    bfloat16 activations (the kernel's fast path) with float accumulation."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [rows, in]
    out = torch._weight_int8pack_mm(rows, weight.q, weight.scales)  # [rows, out] bfloat16
    return out.view(*x.shape[:-1], -1).to(x.dtype)


@functools.cache
def int8_matmul_available(device_type: str) -> bool:
    """Whether this torch has the int8 weight-only kernel on `device_type` (probed once).
    Measured, and so used, on CPU only."""
    if device_type != "cpu" or not hasattr(torch, "_weight_int8pack_mm"):
        return False
    try:
        int8_linear(torch.ones(1, 32), quantize_int8(torch.ones(8, 32)))
    except RuntimeError:
        return False
    return True
