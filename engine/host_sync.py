"""Where the host and the device wait for each other. Reading a result back waits for every kernel
queued before it, so the engine reads in a few known places a step, through `read` (tests count the
calls): one per plain step, and per speculative step one per draft pass plus one for acceptance.
Inputs go the other way through `upload`: on CUDA a copy from pinned memory that does not block the
host (a plain `torch.tensor(values, device="cuda")` copies from pageable memory and waits).
Timing device work takes the clock after such a read, or after `wait` where no read follows the
work. On CPU all three are free: the work is done when the call returns."""

from __future__ import annotations

import torch


def read(tensor: torch.Tensor) -> list:
    """The tensor's values as (nested) Python numbers."""
    return tensor.tolist()


def fetch(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the host (one transfer, a sync on a GPU): for host-side work on many values."""
    return tensor.cpu()


def upload(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (nested Python numbers, or a CPU tensor) as a tensor on `device`, copied without
    blocking the host on CUDA (staged in pinned memory; the caching host allocator keeps the
    staging buffer alive until the copy has run)."""
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def wait(device: torch.device) -> None:
    """Blocks until `device` has finished its queued work (a clock read after it times that work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
