"""Where the host waits for the device. Reading a result back waits for every kernel queued before
it, so the engine reads in a few known places a step, through `read` (tests count the calls):
one per plain step, and per speculative step one per draft pass plus one for acceptance. Timing
device work takes the clock after such a read, or after `wait` where no read follows the work.
On CPU both are free: the work is done when the call returns."""

from __future__ import annotations

import torch


def read(tensor: torch.Tensor) -> list:
    """The tensor's values as (nested) Python numbers."""
    return tensor.tolist()


def wait(device: torch.device) -> None:
    """Blocks until `device` has finished its queued work (a clock read after it times that work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
