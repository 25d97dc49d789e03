"""Which SDPA kernel each of the engine's pass shapes gets (`torch._fused_sdp_choice`), how long the
candidate ways of computing it take, and whether they agree: the map the engine's attention rule on
CUDA is chosen from. Shapes are the Llama-3.2-1B's heads (32 query, 8 KV, 64 dims) in bf16, in the
layout the engine calls attention with (q [B, H, T, D]; keys and values [Hkv, B, L, D] from the pool)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from bench.gpu.context import Context, check
from engine.model.attention import CUDA_ATTENTION_BACKENDS, attention_branch
from engine.model.transformer import Transformer

# (name, batch, queries per sequence, keys, whether rows differ in length)
SHAPES = [("prefill 512, fresh", 1, 512, 512, False), ("prefill chunk 512 after 1536", 1, 512, 2048, False),
          ("decode b1, 1024 keys", 1, 1, 1024, False), ("verify b1 K=4, 1024 keys", 1, 5, 1024, False),
          ("decode b32, ragged", 32, 1, 1024, True), ("verify b8 K=4, ragged", 8, 5, 1024, True)]
SMOKE_SHAPES = [(n, b, min(t, 64), min(keys, 128), r) for n, b, t, keys, r in SHAPES]


def causal_mask(lengths: list[int], T: int, L: int, device) -> torch.Tensor:
    """[B, 1, T, L] bool: row b's T queries sit at its last T positions (lengths[b] keys in all)."""
    pos = torch.tensor(lengths, device=device)[:, None] - T + torch.arange(T, device=device)[None, :]  # [B, T]
    return (torch.arange(L, device=device)[None, None, :] <= pos[:, :, None]).unsqueeze(1)


def variants(scale: float) -> dict[str, Callable]:
    """Ways to compute attention(q [B, H, T, D], k/v [Hkv, B, L, D], mask [B, 1, T, L]) -> [B, H, T, D]."""
    def gqa_masked(q, k, v, mask):  # what the engine called before the CUDA rule
        return F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    def expanded(q, k, v, mask):  # K/V copied out to every query head: the mask-taking fused kernel runs
        G = q.shape[1] // k.shape[0]
        k2, v2 = (x.transpose(0, 1).repeat_interleave(G, dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask, scale=scale)

    def lower_right(q, k, v, mask):  # a causal chunk at the end of its keys, no mask tensor
        return F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), scale=scale, enable_gqa=True,
                                              attn_mask=causal_lower_right(q.shape[2], k.shape[2]))

    def grouped_matmul(q, k, v, mask):  # the engine's few-query path: no K/V copies, fp32 scores
        B, H, T, D = q.shape
        Hkv, L = k.shape[0], k.shape[2]
        G = H // Hkv
        qg = q.reshape(B, Hkv, G * T, D).transpose(0, 1)
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
        scores = scores.view(Hkv, B, G, T, L).masked_fill(~mask.unsqueeze(0), float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype).view(Hkv, B, G * T, L)
        return torch.matmul(probs, v).transpose(0, 1).reshape(B, H, T, D)

    return {"sdpa_gqa_masked": gqa_masked, "expanded_kv_masked": expanded, "causal_lower_right": lower_right,
            "grouped_matmul": grouped_matmul}


def fused_choice(q, k, v, mask, enable_gqa: bool, is_causal: bool = False) -> str:
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, scale=None,
                                                  enable_gqa=enable_gqa)).name
    except Exception as exc:  # private API: its signature may move between versions
        return f"unknown ({type(exc).__name__})"


def _flash_takes(q, k, enable_gqa: bool) -> bool:
    try:
        return torch.backends.cuda.can_use_flash_attention(
            torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, True, enable_gqa))
    except Exception:  # no CUDA build, or the API moved: then it cannot say yes
        return False


def engine_way(q, k, v, mask, kind: str, device_type: str) -> tuple[str, str, Callable]:
    """The engine's branch for this pass (attention_branch), the kernel it reaches, and a call of
    Transformer._attention taking that branch."""
    B, H, T, _ = q.shape
    Hkv, L = k.shape[0], k.shape[2]
    keys, values = k.transpose(0, 1), v.transpose(0, 1)
    flash = kind == "causal_tail" and H != Hkv and _flash_takes(q, keys, True)
    branch = attention_branch(device_type, B, T, L, H, Hkv, kind, flash)
    expanded = [x.repeat_interleave(H // Hkv, dim=1) for x in (keys, values)]
    if branch == "grouped":
        kernel = "matmuls (no SDPA)"
    elif branch == "sdpa_causal" and T == L:
        kernel = fused_choice(q, keys, values, None, H != Hkv, is_causal=True)
    elif branch == "sdpa_causal":
        kernel = "FLASH_ATTENTION (lower right)" if _flash_takes(q, keys, H != Hkv) else "EFFICIENT or MATH (lower right)"
    elif branch == "sdpa_causal_expanded":
        kernel = "FLASH_ATTENTION (lower right)" if _flash_takes(q, expanded[0], False) else "EFFICIENT or MATH (lower right)"
    elif branch == "sdpa_expanded":
        kernel = fused_choice(q, *expanded, mask, False)
    else:
        kernel = fused_choice(q, keys, values, None if kind == "none" else mask, H != Hkv)
    model = object.__new__(Transformer)  # _attention reads only the scale
    model.scale = q.shape[-1] ** -0.5
    return branch, kernel, lambda q, k, v, mask: model._attention(q, k, v, None if kind == "none" else mask, branch)


def run(ctx: Context, out: dict) -> None:
    heads, kv_heads, dim = ctx.size((32, 8, 64), (8, 2, 16))
    dtype = torch.bfloat16 if ctx.device.startswith("cuda") else torch.float32
    repeats = ctx.size(20, 3)
    scale = dim ** -0.5
    ways = variants(scale)
    g = torch.Generator(device=ctx.device).manual_seed(0)
    rows = out["shapes"] = {}
    backends = sdpa_kernel(CUDA_ATTENTION_BACKENDS) if ctx.device.startswith("cuda") else sdpa_kernel(
        [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    with backends, torch.inference_mode():
        for name, B, T, L, ragged in ctx.size(SHAPES, SMOKE_SHAPES):
            lengths = [L - (b * 37 % (L // 2)) if ragged else L for b in range(B)]
            q = torch.randn(B, heads, T, dim, generator=g, device=ctx.device).to(dtype)
            k, v = (torch.randn(kv_heads, B, L, dim, generator=g, device=ctx.device).to(dtype) for _ in range(2))
            mask = causal_mask(lengths, T, L, ctx.device)
            row = rows[name] = {"B": B, "T": T, "L": L, "ragged": ragged,
                                "fused_choice": {"gqa_masked": fused_choice(q, k.transpose(0, 1), v.transpose(0, 1), mask, True),
                                                 "gqa_unmasked": fused_choice(q, k.transpose(0, 1), v.transpose(0, 1), None, True),
                                                 "expanded_masked": fused_choice(
                                                     q, *(x.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=1)
                                                          for x in (k, v)), mask, False)},
                                "ms": {}, "max_abs_diff": {}}
            reference = ways["grouped_matmul"](q.float(), k.float(), v.float(), mask)
            kind = "general" if ragged else "none" if T == 1 else "causal_tail"
            branch, kernel, engine_call = engine_way(q, k, v, mask, kind, "cuda" if ctx.device.startswith("cuda") else "cpu")
            row.update(engine_branch=branch, engine_kernel=kernel)
            candidates = {"engine": engine_call, **{n: f for n, f in ways.items() if n != "causal_lower_right" or not ragged}}
            for way, fn in candidates.items():
                try:
                    result = fn(q, k, v, mask)
                    row["max_abs_diff"][way] = float((result.float() - reference).abs().max())
                    times = [ctx.timed(lambda fn=fn, q=q, k=k, v=v, mask=mask: fn(q, k, v, mask))[1] for _ in range(repeats)]
                    row["ms"][way] = round(1e3 * statistics.median(times), 4)
                except Exception as exc:  # a kernel refusing a shape is itself a finding
                    row["ms"][way] = f"{type(exc).__name__}: {str(exc)[:200]}"
            tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
            check(out, f"{name}: every way agrees with fp32", all(d < tolerance for d in row["max_abs_diff"].values()),
                  row["max_abs_diff"])
            timed = {w: ms for w, ms in row["ms"].items() if isinstance(ms, float)}
            row["fastest"] = min(timed, key=timed.get) if timed else None
            ctx.log(f"{name}: engine {branch} -> {kernel}; fused choice masked {row['fused_choice']['gqa_masked']}, "
                    + ", ".join(f"{w} {ms} ms" for w, ms in row["ms"].items() if isinstance(ms, float)))
    out["summary"] = [f"{n}: engine takes {r['engine_branch']} ({r['engine_kernel']}); "
                      f"SDPA picks {r['fused_choice']['gqa_masked']} masked / {r['fused_choice']['gqa_unmasked']} "
                      f"unmasked / {r['fused_choice']['expanded_masked']} expanded; fastest {r['fastest']} "
                      f"({', '.join(f'{w} {ms}' for w, ms in r['ms'].items() if isinstance(ms, float))} ms)"
                      for n, r in rows.items()]
