"""How much KV memory a sequence and the pools get: the default max_seq_len from the device's
memory, and the pools' block count from the memory the device reports free once both models are
loaded (vLLM's gpu_memory_utilization, as a share of what is free rather than of the whole card)."""

from __future__ import annotations

import os

import torch

from engine.model.transformer import ModelShape

KV_MEMORY_SHARE = 0.25  # the default max_seq_len keeps max_batch_size full sequences' KV within this share


def kv_bytes_per_token(shapes: list[ModelShape], value_bytes: list[int]) -> int:
    """K and V of one token in every model (shapes[i] storing values of value_bytes[i] bytes)."""
    return sum(2 * s.num_layers * s.num_kv_heads * s.head_dim * b for s, b in zip(shapes, value_bytes))


def default_max_seq_len(shapes: list[ModelShape], value_bytes: int, max_batch_size: int, memory_bytes: int) -> int:
    """The longest sequence every model runs (its positions or sliding window), lowered until
    max_batch_size sequences of that length keep their KV within KV_MEMORY_SHARE of the memory."""
    fits = int(KV_MEMORY_SHARE * memory_bytes // (kv_bytes_per_token(shapes, [value_bytes] * len(shapes))
                                                   * max_batch_size))
    return max(2, min(min(s.max_sequence for s in shapes), fits))


def free_memory(device: str) -> int:
    """Bytes `device` can still allocate: CUDA's free memory, or the RAM Linux reports available."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def pool_blocks(free_bytes: int, fraction: float, bytes_per_token: int, block_size: int, max_batch_size: int,
                max_seq_len: int, paged: bool) -> int:
    """Blocks for each pool (the target's and the draft's hold the same sequences): as many as
    max_batch_size sequences of max_seq_len use, at most what `fraction` of the free memory holds.
    ValueError when not even one sequence of max_seq_len fits (or, slotted, not every slot)."""
    blocks_per_seq = -(-max_seq_len // block_size) if paged else 1
    block_bytes = bytes_per_token * (block_size if paged else max_seq_len)
    fits = int(fraction * free_bytes) // block_bytes
    needed = blocks_per_seq if paged else max_batch_size
    if fits < needed:
        raise ValueError(
            f"kv_cache_memory_fraction {fraction} of the {free_bytes / 2**30:.2f} GiB free holds "
            f"{fits * block_bytes // bytes_per_token} tokens of KV ({bytes_per_token} bytes a token, both models), "
            f"less than {'one sequence' if paged else f'{max_batch_size} slots'} of max_seq_len {max_seq_len}: "
            "lower max_seq_len" + ("" if paged else " or max_batch_size") + ", or raise kv_cache_memory_fraction")
    return min(fits, max_batch_size * blocks_per_seq)
