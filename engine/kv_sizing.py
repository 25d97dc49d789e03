"""How much KV memory a sequence and the pools get: the default max_seq_len from the device's
memory, and the pools' block count from the memory the device reports free once both models are
loaded (vLLM's gpu_memory_utilization, as a share of what is free rather than of the whole card)."""

from __future__ import annotations

import os

import torch

from engine.model.shape import ModelShape

KV_MEMORY_SHARE = 0.25  # the default max_seq_len keeps max_batch_size full sequences' KV within this share
ACTIVATION_SAFETY = 1.5  # the activation reserve over the tensors it counts: allocator rounding, uncounted temporaries
LOGIT_BYTES = 20  # per target logit a verify samples: float32 logits, adjusted probabilities, top-k/top-p sort (values, int64 order)
PROPOSAL_LOGIT_BYTES = 8  # per proposer logit kept for acceptance: float32 logits and q


def kv_bytes_per_token(shapes: list[ModelShape], value_bytes: list[int]) -> int:
    """K and V of one token in every model (shapes[i] storing values of value_bytes[i] bytes)."""
    return sum(2 * s.num_layers * s.num_kv_heads * s.head_dim * b for s, b in zip(shapes, value_bytes))


def default_max_seq_len(shapes: list[ModelShape], value_bytes: int, max_batch_size: int, memory_bytes: int) -> int:
    """The longest sequence every model runs (its positions or sliding window), lowered until
    max_batch_size sequences of that length keep their KV within KV_MEMORY_SHARE of the memory."""
    fits = int(KV_MEMORY_SHARE * memory_bytes // (kv_bytes_per_token(shapes, [value_bytes] * len(shapes))
                                                   * max_batch_size))
    return max(2, min(min(s.max_sequence for s in shapes), fits))


def activation_bytes(shapes: list[ModelShape], value_bytes: list[int], max_batch_size: int, spec_tokens: int,
                     max_num_batched_tokens: int, max_seq_len: int) -> int:
    """Peak bytes, beyond weights and KV, of the largest pass the config allows, times ACTIVATION_SAFETY
    (shapes[0] is the target; shapes[i] computes in value_bytes[i]-byte values). The larger of:
    - a verify of spec_tokens proposals (a decode when 0) over R = max_batch_size * (spec_tokens + 1)
      rows: R * vocab * LOGIT_BYTES for the target's logits and sampling, max_batch_size *
      spec_tokens * vocab * PROPOSAL_LOGIT_BYTES for the proposals' q, R tokens' layer activations,
      and the grouped attention path's float32 scores and probabilities, R * heads * max_seq_len * (8 + value bytes);
    - a prefill pass of max_num_batched_tokens tokens: their layer activations, and one layer's keys
      and values read and repeated to every query head, over the pass's keys and one max_seq_len sequence.
    A token's layer activations: value bytes * (3 * hidden + q/k/v width + 3 * intermediate) (residual,
    normed input, attention output; q, k, v; gate, up and their product); each term takes the widest model."""
    def widest(f) -> int:
        return max(f(s, b) for s, b in zip(shapes, value_bytes))

    per_token = widest(lambda s, b: b * (3 * s.hidden_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
                                         + 3 * s.intermediate_size))
    vocab = max(s.vocab_size for s in shapes)  # a head's q spans its target's vocabulary
    rows = max_batch_size * (spec_tokens + 1)
    verify = (rows * shapes[0].vocab_size * LOGIT_BYTES + max_batch_size * spec_tokens * vocab * PROPOSAL_LOGIT_BYTES
              + rows * per_token + rows * max_seq_len * widest(lambda s, b: s.num_heads * (8 + b)))
    keys = max_num_batched_tokens + max_seq_len
    prefill = max_num_batched_tokens * per_token \
        + keys * widest(lambda s, b: 2 * (s.num_heads + s.num_kv_heads) * s.head_dim * b)
    return int(ACTIVATION_SAFETY * max(verify, prefill))


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
                max_seq_len: int, paged: bool, reserve_bytes: int = 0) -> int:
    """Blocks for each pool (the target's and the draft's hold the same sequences): as many as
    max_batch_size sequences of max_seq_len use, at most what `fraction` of the free memory, less
    reserve_bytes kept for activations (activation_bytes), holds. ValueError when not even one
    sequence of max_seq_len fits (or, slotted, not every slot)."""
    blocks_per_seq = -(-max_seq_len // block_size) if paged else 1
    block_bytes = bytes_per_token * (block_size if paged else max_seq_len)
    fits = int(fraction * max(0, free_bytes - reserve_bytes)) // block_bytes
    needed = blocks_per_seq if paged else max_batch_size
    if fits < needed:
        raise ValueError(
            f"kv_cache_memory_fraction {fraction} of the {free_bytes / 2**30:.2f} GiB free, less an activation "
            f"reserve of {reserve_bytes / 2**30:.2f} GiB, holds "
            f"{fits * block_bytes // bytes_per_token} tokens of KV ({bytes_per_token} bytes a token, both models), "
            f"less than {'one sequence' if paged else f'{max_batch_size} slots'} of max_seq_len {max_seq_len}: "
            "lower max_seq_len" + ("" if paged else " or max_batch_size") + ", or raise kv_cache_memory_fraction"
            + ("; the activation reserve shrinks with max_batch_size, spec_length and max_num_batched_tokens"
               if reserve_bytes else ""))
    return min(fits, max_batch_size * blocks_per_seq)
