"""Which attention code a pass takes, by its shape and mask, on CPU and CUDA (the rule the
Transformer follows; bench gpu's `attention` section checks it against the kernels torch picks)."""

from __future__ import annotations

import functools
import inspect

from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import CausalBias, causal_lower_right

CUDA_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
FEW_QUERY_ROWS = 16  # attention passes of at most this many query rows (decode, verify) count as few
# relied on (torch 2.11 CUDA, sdp_utils.cpp and nn/attention/bias.py): flash takes enable_gqa, no mask, is_causal only
# at T == L, and CausalBias lower-right at any T <= L; memory-efficient takes a mask and lower-right but no GQA
_CAUSAL_BIAS_TAKES_GQA = "enable_gqa" in inspect.signature(CausalBias._dispatch).parameters


def attention_branch(device_type: str, B: int, T: int, L: int, H: int, Hkv: int, mask: str,
                     flash_gqa: bool = False) -> str:
    """Which attention code a pass of B rows of T queries over L keys (H query heads, Hkv KV
    heads) takes on `device_type` ("cpu", "cuda", or a CPU rule under row-count invariance,
    engine/model/invariance.py: "cpu_invariant" in bf16, "cpu_fixed_order" in float32); mask:
    "none" (every key visible), "causal_tail" (each row's queries are exactly its last T keys:
    lower-right causal) or "general" (any boolean mask);
    flash_gqa: flash attention takes these inputs with GQA (half precision, head_dim, GPU).

    Branches: "sdpa" (SDPA, the boolean mask if any, GQA by enable_gqa); "grouped" (explicit
    matmuls, the query heads of a KV head stacked as rows: no copy of K/V); "sdpa_causal" (SDPA
    with is_causal or causal_lower_right, no mask tensor, GQA by enable_gqa); "sdpa_causal_expanded"
    and "sdpa_expanded" (the same, and the boolean mask, with K/V repeated to every query head, so
    the memory-efficient kernel takes them); "fixed_order" (a C kernel summing each query row over
    the keys it sees in key order). Every branch computes the same attention; on CUDA the
    rule keeps masked GQA passes off the math kernel, whose scores are [B, heads, T, L] float32.
    """
    few = T <= FEW_QUERY_ROWS
    if device_type == "cpu_invariant":  # row-count invariance (invariance.py): one path for every pass
        return "grouped"
    if device_type == "cpu_fixed_order":
        return "fixed_order"
    if device_type != "cuda":
        return "sdpa" if B == 1 or not few else "grouped"
    gqa = H != Hkv
    if mask == "causal_tail" and T <= L:
        if not gqa or flash_gqa:
            return "sdpa_causal"
        return "grouped" if few else "sdpa_causal_expanded"
    if mask == "none" or not gqa:  # no mask: flash takes GQA; MHA: memory-efficient takes the mask
        return "sdpa" if B == 1 or not few else "grouped"
    return "grouped" if few else "sdpa_expanded"


@functools.lru_cache(maxsize=256)
def lower_right(T: int, L: int) -> CausalBias:
    """The lower-right causal bias of T queries over L keys (no tensor until a kernel needs one)."""
    return causal_lower_right(T, L)
