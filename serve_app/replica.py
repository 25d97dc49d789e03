"""The replica process as the serving layer sees it: its id, node, memory and torch threads, and
the fault hooks the reliability suite turns on (SPECSERVE_TEST_HOOKS=1, never by default)."""

from __future__ import annotations

import math
import os

from ray import serve

FAULT_USER = "specserve-test-fault"  # with SPECSERVE_TEST_HOOKS=1: this request fails mid-generation
FAULT_PREFIX = "fault-"
DEVICE_FAULT_USER = "specserve-test-device-fault"  # ... this one raises a (simulated) sticky CUDA error
DEVICE_FAULT_PREFIX = "devicefault-"


def inject_fault(request) -> None:
    if request.request_id.startswith(FAULT_PREFIX) and len(request.output_token_ids) >= 2:
        raise RuntimeError("injected fault (SPECSERVE_TEST_HOOKS)")
    if request.request_id.startswith(DEVICE_FAULT_PREFIX) and len(request.output_token_ids) >= 2:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected, SPECSERVE_TEST_HOOKS)")


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return "unknown"


def rss_bytes() -> int:
    """Resident memory of this replica process (Linux /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def threads_for_replica(requested: int | None) -> int:
    """Torch threads = the CPUs Ray assigned to this replica (rounded up), unless set; 1 outside a
    Ray worker (never connecting to a cluster to ask)."""
    if requested:
        return requested
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0) if ray.is_initialized() else 1.0
    except Exception:
        cpus = 1.0
    return max(1, math.ceil(cpus))


def node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None
