"""A checkpoint's dimensions and per-family options (`ModelShape`, read from config.json by
families.py) and one decoder layer's weights (`LayerWeights`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.model.rope import Rope

if TYPE_CHECKING:
    from engine.model.mlp import MLP


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts model's experts (Qwen3-MoE): each token through its top_k of
    num_experts SwiGLU experts of intermediate_size, in every layer but dense_layers."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool  # the top k's router weights renormalised to sum to one
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead (mlp_only_layers, decoder_sparse_step)


@dataclass(frozen=True)
class ModelShape:
    """A checkpoint's dimensions and the options that tell its family apart: q/k/v biases (Qwen2),
    per-head q/k RMSNorm (Qwen3), a sliding window (Mistral; the engine keeps sequences within it)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"  # its family (families.py): which MLP and which tensors
    moe: MoEShape | None = None  # a mixture-of-experts model's experts

    @property
    def max_sequence(self) -> int:
        """The longest sequence the forward computes exactly: the model's positions, or its sliding
        window where shorter (within it, sliding-window attention is full attention)."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)


@dataclass
class LayerWeights:
    """One decoder layer's weights."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden] (None: a mixture-of-experts layer)
    down: torch.Tensor | None  # [hidden, intermediate]
    qkv_bias: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim]
    o_bias: torch.Tensor | None = None  # [hidden]
    qk_norm: torch.Tensor | None = None  # [heads + kv_heads, head_dim]: q's norm per query head, then k's
    mlp: MLP | None = None  # the layer's MLP (mlp.py: SwiGLU over gate_up and down, or experts.py's), set at load

    def tensors(self) -> list:
        """Its tensors, and what its MLP holds of its own (a mixture of experts)."""
        return [t for k, t in vars(self).items() if t is not None and k != "mlp"] + \
            (self.mlp.weights() if self.mlp is not None else [])
