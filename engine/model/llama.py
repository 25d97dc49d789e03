"""Llama forward pass written against our KV-cache views.

Covers what Llama 2/3/3.2 checkpoints use: RMSNorm, rotary embeddings (plain and the `llama3`
rope_scaling), grouped-query attention, SwiGLU MLP, tied or untied embeddings. Weights live in
plain tensors (q/k/v and gate/up fused so a layer is four matmuls); the forward is functional so
one code path serves prefill, decode, chunked prefill and the speculative verify pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv.protocol import KVView


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaShape:
        model_type = cfg.get("model_type")
        if model_type not in ("llama", None):
            raise ValueError(f"unsupported model_type {model_type!r}: this engine runs Llama checkpoints")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3)")
    return dict(scaling)


def rope_inv_freq(shape: LlamaShape) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), with llama3 scaling applied if configured."""
    dim = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    s = shape.rope_scaling
    if s is None:
        return inv_freq
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are slowed down by `factor`, short ones kept, and the
    # band in between interpolates linearly in 1/wavelength between the two.
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    blend = (original / wavelength - low) / (high - low)
    interpolated = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(in_band, interpolated, scaled)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class Llama:
    """Functional Llama over explicit weights. Thread-compatible, holds no per-request state."""

    def __init__(self, shape: LlamaShape, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, max_positions: int):
        self.shape = shape
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.final_norm = final_norm  # [hidden]
        self.lm_head = lm_head  # [vocab, hidden] (the embedding itself when tied)
        self.dtype = embed.dtype
        self.device = embed.device
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(shape))  # [max_positions, head_dim // 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos = angles.cos().to(self.dtype).to(self.device)  # [max_positions, head_dim]
        self.sin = angles.sin().to(self.dtype).to(self.device)  # [max_positions, head_dim]
        self.scale = shape.head_dim ** -0.5

    @property
    def num_parameters(self) -> int:
        tensors = [self.embed, self.final_norm] + [t for lw in self.layers for t in vars(lw).values()]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        return sum(t.numel() for t in tensors)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVView,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """Runs the model on new tokens, writing their K/V through `kv`.

        input_ids, position_ids: [B, T] (padded rows carry position 0 and are written to the
        view's scratch row). logits_index: [B] index along T whose logits to return (decode /
        last prefill token) or None for all positions (speculative verify).
        Returns logits [B, vocab] or [B, T, vocab] (float32).
        """
        s = self.shape
        B, T = input_ids.shape
        h = F.embedding(input_ids, self.embed)  # [B, T, hidden]
        cos = self.cos[position_ids].unsqueeze(2)  # [B, T, 1, head_dim]
        sin = self.sin[position_ids].unsqueeze(2)  # [B, T, 1, head_dim]
        mask = kv.attention_mask(position_ids)  # [B, 1, T, L] bool, or None = attend to all L
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for i, lw in enumerate(self.layers):
            x = self._rms_norm(h, lw.attn_norm)
            qkv = F.linear(x, lw.qkv)  # [B, T, q_size + 2 * kv_size]
            q = qkv[..., :q_size].view(B, T, s.num_heads, s.head_dim)
            k = qkv[..., q_size:q_size + kv_size].view(B, T, s.num_kv_heads, s.head_dim)
            v = qkv[..., q_size + kv_size:].view(B, T, s.num_kv_heads, s.head_dim)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            keys, values = kv.write_and_read(i, k, v)  # each [B, L, kv_heads, head_dim]
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=mask, scale=self.scale, enable_gqa=s.num_heads != s.num_kv_heads,
            )  # [B, heads, T, head_dim]
            h = h + F.linear(attn.transpose(1, 2).reshape(B, T, q_size), lw.o)
            x = self._rms_norm(h, lw.mlp_norm)
            gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)  # each [B, T, intermediate]
            h = h + F.linear(F.silu(gate) * up, lw.down)
        if logits_index is not None:
            h = h[torch.arange(B, device=h.device), logits_index]  # [B, hidden]
        h = self._rms_norm(h, self.final_norm)
        return F.linear(h, self.lm_head).float()  # [B, vocab] or [B, T, vocab]
