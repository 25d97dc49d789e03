"""Each layer's pointwise work in fused kernels (kernels/fused.py) on the GPU, behind a load-time
check like the graphs': a model takes them where its passes with them equal the eager ones on a
probe; else it stays eager, with a warning saying why. A layer's MLP runs inside them with the
fused SiLU-and-multiply passed to it (mlp.py): a family's own MLP keeps the fused norms and RoPE."""

from __future__ import annotations

from engine.model.probe import compare_on_probe


def fused_on(setting: str, device: str) -> bool:
    """EngineConfig.fused_kernels: "auto" on CUDA only; "on" also on CPU (Triton's interpreter: tests)."""
    return setting == "on" or (setting == "auto" and device.startswith("cuda"))


def unsupported(model) -> str | None:
    """Why `model` cannot take the fused path, or None."""
    D = model.shape.head_dim
    if D & (D - 1):
        return f"head_dim {D} is not a power of two"
    return None


def check_fused(model, pool, tolerance: float) -> str | None:
    """Turns the fused path on for `model` where it is supported and equals the eager one on a
    probe over `pool`; why not, or None (on)."""
    problem = unsupported(model)
    if problem is not None:
        return problem

    def switch(on: bool) -> None:
        model.fused = on
    try:
        differs = compare_on_probe(model, pool, switch, tolerance)
        problem = None if differs is None else f"fused differs from eager {differs}"
    except Exception as e:  # a kernel that does not build or run here
        problem = f"{type(e).__name__}: {e}"
    model.fused = problem is None
    return problem
