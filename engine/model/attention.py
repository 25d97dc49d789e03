"""Which attention code a pass takes, by its shape and mask, on CPU and CUDA (the rule the
Transformer follows; bench gpu's `attention` section checks it against the kernels torch picks),
and each branch's computation (`attend`)."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import CausalBias, causal_lower_right

from engine.model.kernels import invariant, one_sequence

CUDA_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
FEW_QUERY_ROWS = 16  # attention passes of at most this many query rows (decode, verify) count as few
# relied on (torch 2.11 CUDA, sdp_utils.cpp and nn/attention/bias.py): flash takes enable_gqa, no mask, is_causal only
# at T == L, and CausalBias lower-right at any T <= L; memory-efficient takes a mask and lower-right but no GQA
_CAUSAL_BIAS_TAKES_GQA = "enable_gqa" in inspect.signature(CausalBias._dispatch).parameters
GROUPED_QUERY_CHUNK = 128  # queries per call of the grouped attention matmuls (a prefill's, under invariance)


def attention_branch(device_type: str, B: int, T: int, L: int, H: int, Hkv: int, mask: str,
                     flash_gqa: bool = False) -> str:
    """Which attention code a pass of B rows of T queries over L keys (H query heads, Hkv KV
    heads) takes on `device_type` ("cpu", "cuda", or a rule under row-count invariance,
    engine/model/invariance.py: "cpu_invariant" or "cpu_fixed_order" on CPU, "cuda_fixed_order"); mask:
    "none" (every key visible), "causal_tail" (each row's queries are exactly its last T keys:
    lower-right causal) or "general" (any boolean mask);
    flash_gqa: flash attention takes these inputs with GQA (half precision, head_dim, GPU).

    Branches: "sdpa" (SDPA, the boolean mask if any, GQA by enable_gqa); "grouped" (explicit
    matmuls, the query heads of a KV head stacked as rows: no copy of K/V); "sdpa_causal" (SDPA
    with is_causal or causal_lower_right, no mask tensor, GQA by enable_gqa); "sdpa_causal_expanded"
    and "sdpa_expanded" (the same, and the boolean mask, with K/V repeated to every query head, so
    the memory-efficient kernel takes them); "fixed_order" (a C kernel summing each query row over
    the keys it sees in key order); "fixed_order_triton" (its Triton twin, kernels/invariant.py).
    Every branch computes the same attention; on CUDA the
    rule keeps masked GQA passes off the math kernel, whose scores are [B, heads, T, L] float32.
    """
    few = T <= FEW_QUERY_ROWS
    if device_type == "cpu_invariant":  # row-count invariance (invariance.py): one path for every pass
        return "grouped"
    if device_type == "cpu_fixed_order":
        return "fixed_order"
    if device_type == "cuda_fixed_order":
        return "fixed_order_triton"
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, branch: str,
           scale: float) -> torch.Tensor:
    """q [B, heads, T, D], k/v [kv_heads, B, L, D], mask [B, 1, T, L] (None: every key) -> [B, heads, T, D],
    by the attention_branch named `branch`."""
    H, T = q.shape[1], q.shape[2]
    Hkv, L = k.shape[0], k.shape[2]
    if branch == "grouped":
        return grouped_matmuls(q, k, v, mask, scale)
    if branch == "fixed_order":  # row-count invariance (kernels/fixed_order_attention.c)
        return one_sequence.load().attention(q, k, v, mask, scale).to(q.dtype)
    if branch == "fixed_order_triton":
        return invariant.fixed_order_attention(q, k, v, mask, scale)
    keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [B, kv_heads, L, D]
    gqa = H != Hkv
    if gqa and (branch in ("sdpa_expanded", "sdpa_causal_expanded")
                or branch == "sdpa_causal" and T != L and not _CAUSAL_BIAS_TAKES_GQA):
        keys = keys.repeat_interleave(H // Hkv, dim=1)  # [B, heads, L, D], a copy
        values = values.repeat_interleave(H // Hkv, dim=1)
        gqa = False
    if branch in ("sdpa_causal", "sdpa_causal_expanded"):  # the view's mask is lower-right causal
        if T == L:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=lower_right(T, L), scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


def grouped_matmuls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """`attend` as explicit matmuls (few queries: no copy of K/V, small float32 scores; many, under
    row-count invariance: GROUPED_QUERY_CHUNK queries a call, to bound the scores)."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[0], k.shape[2]
    if T > GROUPED_QUERY_CHUNK:
        return torch.cat([grouped_matmuls(q[:, :, t:t + GROUPED_QUERY_CHUNK], k, v,
                                          None if mask is None else mask[:, :, t:t + GROUPED_QUERY_CHUNK], scale)
                          for t in range(0, T, GROUPED_QUERY_CHUNK)], dim=2)
    # the query heads sharing a KV head are stacked as rows; the batch runs over (kv_head,
    # sequence), the order keys and values arrive in, so only queries and outputs are reordered
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, D).transpose(0, 1)  # [kv_heads, B, group * T, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [kv_heads, B, group * T, L]
    if mask is not None:
        scores = scores.view(Hkv, B, G, T, L).masked_fill(~mask.unsqueeze(0), float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype).view(Hkv, B, G * T, L)
    out = torch.matmul(probs, v)  # [kv_heads, B, group * T, D]
    return out.transpose(0, 1).reshape(B, H, T, D)
