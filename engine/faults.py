"""Errors after which the device's state cannot be trusted: a CUDA error is sticky (every later
call on the context fails), and running out of memory mid-step can leave pools half-written. The
engine lets them through instead of failing one request, and the serving loop stops on them so
the health check fails and the replica is replaced."""

from __future__ import annotations

import torch

DEVICE_FAULT_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS_",
                        "CUDNN_STATUS_", "NCCL error", "HIP error")


def is_device_fault(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError) or type(exc).__name__ == "AcceleratorError":
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in DEVICE_FAULT_MARKERS)
