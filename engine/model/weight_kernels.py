"""The Triton kernels that read a model's weights, chosen at load and each checked on a probe
before any pass runs: the quantized linears' (kernels/quant.py, setting `quant_kernels`) and the
experts' (kernels/moe.py, setting `moe_kernels`). "auto" takes them on CUDA; "on" also on CPU
(Triton's interpreter: tests); "off" never. A kernel that does not build or disagrees with the
dequantized (or eager) result on the probe is reported under its own name, and its layers take
the path that always works: dequantized a layer a call, the host-grouped experts.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.model.experts import Experts
from engine.model.quant.linear import LinearParts, QuantLinear, device_capability

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 5, 17)  # a decode pass, a verify pass, one past a row tile


def kernels_on(setting: str, device: str) -> bool:
    return setting == "on" or (setting == "auto" and device.startswith("cuda"))


def quant_linears(model) -> list[QuantLinear]:
    out = []
    for lw in model.layers:
        for w in (lw.qkv, lw.o, lw.gate_up, lw.down):
            out += [p for p in w.parts if isinstance(p, QuantLinear)] if isinstance(w, LinearParts) else \
                [w] if isinstance(w, QuantLinear) else []
    return out


def choose_quant(model, setting: str, role: str) -> str | None:
    """Prepares `model`'s quantized linears for the setting; the paths they took, or None (none)."""
    layers = quant_linears(model)
    if not layers:
        return None
    dtype, device = model.dtype, model.device
    if kernels_on(setting, str(device)):
        cap = device_capability(device)
        for layer in layers:
            layer.prepare(dtype, triton=True, capability=cap)
        for form in {_form(layer) for layer in layers}:
            sample = next(layer for layer in layers if _form(layer) == form)
            if not sample.path.startswith("triton"):
                continue
            problem, kernel = _probe_linear(sample, dtype), sample.path
            if problem is not None:
                log.warning("quant_kernels: the %s's %s kernel %s; its %s linears dequantize a layer a call",
                            role, kernel, problem, sample.form)
                for layer in layers:
                    if _form(layer) == form:
                        layer.prepare(dtype, triton=False)
                        layer.path = f"dequantized ({kernel}: {problem})"
    elif device.type == "cuda":
        for layer in layers:
            layer.prepare(dtype, triton=False)
    return ", ".join(f"{form}: {path}" for form, path in sorted({(layer.form, layer.path) for layer in layers}))


def _form(layer: QuantLinear) -> tuple:
    return layer.kind, layer.bits, layer.block, layer.group, layer.perm is not None


def _probe(width: int, dtype: torch.dtype, device: torch.device, run, reference: str, unit: str) -> str | None:
    """run(x) -> (got, want) for random x [rows, width] at each of PROBE_ROWS, compared within the
    dtype's tolerance relative to want's largest value; what is wrong, or None."""
    g = torch.Generator().manual_seed(0)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    try:
        for rows in PROBE_ROWS:
            got, want = run(torch.randn(rows, width, generator=g).to(device=device, dtype=dtype))
            worst, scale = (got.float() - want.float()).abs().max().item(), want.float().abs().max().item()
            if not worst <= tolerance * max(scale, 1.0):
                return f"differs from {reference} by {worst:.3g} (scale {scale:.3g}) at {rows} {unit}"
    except Exception as e:  # a kernel that does not build or run here
        return f"failed: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''}"
    return None


def _probe_linear(layer: QuantLinear, dtype: torch.dtype) -> str | None:
    """The kernel's result against the dequantized weight's; what is wrong, or None."""
    weight = layer.dequantize(torch.float32)

    def run(x):
        return layer(x), F.linear((x if layer.perm is None else x.index_select(-1, layer.perm)).float(), weight)
    return _probe(layer.shape[1], dtype, weight.device, run, "the dequantized weight", "rows")


def choose_moe(model, setting: str, role: str) -> str | None:
    """Sets `model`'s experts on the device-sorted Triton kernel or the host-grouped path; the
    path taken, or None (no experts)."""
    experts = [lw.mlp for lw in model.layers if isinstance(lw.mlp, Experts)]
    if not experts:
        return None
    if not kernels_on(setting, str(model.device)):
        for e in experts:
            e.static = False
        return "host-grouped"
    if experts[0].gate_up is None:  # reordered per expert for oneDNN (CPU): the kernel reads the plain stack
        return "host-grouped (the experts are reordered for oneDNN)"
    problem = _probe_experts(experts[0], model.dtype)
    if problem is not None:
        log.warning("moe_kernels: the %s's grouped experts kernel %s; its experts run host-grouped", role, problem)
    for e in experts:
        e.static = problem is None
    return "triton grouped" if problem is None else f"host-grouped (triton grouped: {problem})"


def _probe_experts(experts: Experts, dtype: torch.dtype) -> str | None:
    static = experts.static

    def run(x):
        experts.static = False
        want = experts(x[None], None, F.linear)
        experts.static = True
        return experts(x[None], None, F.linear), want
    try:
        return _probe(experts.shape[2], dtype, experts.gate_up.device, run, "the host-grouped experts", "tokens")
    finally:
        experts.static = static
