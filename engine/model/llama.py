"""Llama forward pass written against our KV-cache views.

Covers what Llama 2/3/3.2 checkpoints use: RMSNorm, rotary embeddings (plain and the `llama3`
rope_scaling), grouped-query attention, SwiGLU MLP, tied or untied embeddings. Weights live in
plain tensors (q/k/v and gate/up fused so a layer is four matmuls); the forward is functional so
one code path serves prefill, decode, chunked prefill and the speculative verify pass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from engine.kv.protocol import AttentionGroup, KVView
from engine.model.int8 import int8_linear, int8_matmul_available, quantize_int8
from engine.model.kernels import one_sequence
from engine.model.token_step import TokenStep


def _use_explicit_attention(batch: int, queries: int) -> bool:
    """Measured on CPU with growing contexts: decode and verify passes over several sequences
    are several times faster as two explicit matmuls (key lengths aligned to KEY_ALIGN, so
    oneDNN's per-shape kernels are reused across steps) than the fused SDPA kernel. One sequence
    takes SDPA: its exact-length keys would need a new oneDNN kernel at every step."""
    return batch > 1 and queries <= 16


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")


def _transposed_linear(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight_t [in, out]: the weight stored transposed, contiguous."""
    return torch.matmul(x, weight_t)


# One-row passes of a draft model multiply small matrices (at most this many elements) with a
# plain matmul over a transposed copy instead of the packed oneDNN kernel. Measured on CPU,
# float32, one row: a packed call costs ~25 us however small the matrix (256x256: 32 us packed,
# 8 us plain; 1408x256: 52 vs 32 us; 1024x512: 53 vs 49 us; 2816x512: 97 vs 120 us).
SINGLE_ROW_PLAIN_MAX_ELEMENTS = 1 << 19


# Draft passes over at most this many rows (batch x tokens) run on int8 weights when asked
# (Llama's int8_few_rows). Measured in place on an AVX2 CPU (the shipped draft, a target verify
# pass between draft passes), int8 / float32 time: 1 row 0.69, 2 rows 0.66-0.73, 4 rows
# 0.77-0.80, 6 rows 0.91, 8 rows 0.94, 16 rows 1.09: wide passes are compute-bound.
INT8_MAX_ROWS = 8


# A target's passes over one sequence of at most this many tokens (decode steps, speculative
# verify passes up to spec_length 64, short prefill chunks) multiply with the one-sequence CPU
# kernel (engine/model/kernels) where it builds. Measured on an AVX2 CPU over the shipped target's
# 33 matmuls: oneDNN 6.6 ms at 1 row and 8.7 at 6; the kernel on float32 weights 4.9 and 6.9, on
# the checkpoint's bfloat16 weights 3.1 and 5.5.
ONE_SEQUENCE_MAX_TOKENS = 65


class LayerKernels(NamedTuple):
    """The matmul each of a layer's weights goes through: f(x [..., in], weight) -> [..., out]."""

    qkv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def cpu_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack `dtype` matmul weights on this CPU (probed once on a tiny tensor).
    float32 packs wherever oneDNN runs; bf16 needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype a model asked to run in `dtype` computes in on `device`.

    On CPUs without bf16 matmul kernels (AVX2 only, e.g. AMD Zen 3) a bf16 matmul costs about
    one single-row matmul per row, which would make a K-token verify pass K times a decode step
    and speculation pointless; such a CPU computes bf16 checkpoints in float32 (weights upcast
    exactly, activations and KV cache in float32): faster than emulated bf16, and a sequence's
    greedy tokens then do not depend on its batch or on speculation."""
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16 and not cpu_packs(torch.bfloat16) \
            and cpu_packs(torch.float32):
        return torch.float32
    return dtype


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
    """One decoder layer's weights (a FewRowPath's int8 copy holds Int8Weights in the four
    matmul fields)."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class FewRowPath(NamedTuple):
    """What passes over at most `max_rows` rows (batch x tokens) multiply with, only passes over
    a single sequence if `one_sequence`: per-layer weights (norms shared with the model's own
    layers), the kernel for each, and the output layer."""

    max_rows: int
    one_sequence: bool
    layers: list[LayerWeights]
    kernels: LayerKernels
    lm_head: Any  # a tensor, or an Int8Weight
    lm_head_kernel: Callable[[torch.Tensor, Any], torch.Tensor]


class Llama:
    """Functional Llama over explicit weights. Thread-compatible, holds no per-request state."""

    def __init__(self, shape: LlamaShape, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, max_positions: int,
                 output_ids: torch.Tensor | None = None, row_invariant: bool = True,
                 int8_few_rows: bool = False, one_sequence_kernels: bool = True, token_step: bool = False):
        """output_ids [V'] (sorted, unique): score only these tokens; every other logit is -inf.
        A draft model restricted to frequent tokens reads a fraction of its output layer.

        row_invariant: a token's result is bit-identical whatever the number of tokens its
        sequence has in the pass, and whatever the number of sequences in a pass over several.
        A target must keep it (its greedy tokens under speculation, computed in verify passes of
        K + 1 tokens, must equal plain decoding's one-token passes). Passes over one sequence
        (up to ONE_SEQUENCE_MAX_TOKENS tokens) may use other kernels than passes over several,
        as attention does. A draft may drop it: its proposals only change how many tokens are
        accepted, never which, so its one-row passes may take faster kernels whose rounding
        differs from the multi-row ones.

        int8_few_rows (needs row_invariant=False): passes over at most INT8_MAX_ROWS rows (a
        draft's steps and a round's first pass) multiply int8 copies of the weights (see
        engine.model.int8), where the kernel exists (CPU); other passes keep the full weights.

        one_sequence_kernels: a row-invariant model computing in float32 on CPU runs its passes
        over one sequence of up to ONE_SEQUENCE_MAX_TOKENS tokens on engine/model/kernels'
        one-sequence kernel where it builds (False: oneDNN's for every pass)."""
        self.shape = shape
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.final_norm = final_norm  # [hidden]
        self.output_ids = output_ids
        if output_ids is not None:
            lm_head = lm_head[output_ids]  # [V', hidden], a copy even when tied
        self.lm_head = lm_head  # [V' or vocab, hidden] (the embedding itself when tied and unrestricted)
        self.dtype = embed.dtype
        self.device = embed.device
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(shape))  # [max_positions, head_dim // 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos = angles.cos().to(self.dtype).to(self.device)  # [max_positions, head_dim]
        sin = angles.sin()
        half = sin.shape[-1] // 2
        signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # rotate-half's sign folded in
        self.sin = signed.to(self.dtype).to(self.device)  # [max_positions, head_dim]
        self.scale = shape.head_dim ** -0.5
        self._num_parameters = self._count_parameters()
        if int8_few_rows and row_invariant:
            raise ValueError("int8_few_rows needs row_invariant=False: only a draft may run on int8 weights")
        if token_step and row_invariant:
            raise ValueError("token_step needs row_invariant=False: its rounding differs from batched passes")
        # taken before packing (it reads the plain weights); None = no token-step passes
        self._token_step = TokenStep.build(shape, embed, layers, final_norm, self.lm_head, output_ids,
                                           self.cos, self.sin) if token_step else None
        self._linear = F.linear
        # passes over few rows (draft steps): their own weights and kernels, or None = as any pass
        self._few_rows: FewRowPath | None = None
        int8 = int8_few_rows and int8_matmul_available(self.device.type)
        if int8:
            self._few_rows = self._int8_path()
        if one_sequence_kernels and row_invariant and self.device.type == "cpu" and self.dtype == torch.float32 \
                and (kernels := one_sequence.load()) is not None:
            self._few_rows = self._one_sequence_path(kernels)
        if self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float32) and cpu_packs(self.dtype):
            transposed = self._small_matrices_transposed() \
                if not row_invariant and not int8 and self.dtype == torch.float32 else None
            self._pack_for_cpu()
            if transposed and transposed[0]:
                self._few_rows = self._single_row_path(transposed)
        # the layers' matmuls in every pass (a draft's few-row passes take `_few_rows`')
        self._kernels = LayerKernels(*[self._linear] * len(LayerKernels._fields))

    def _pack_for_cpu(self) -> None:
        """Re-lays the matmul weights out for oneDNN: small-batch matmuls 1.5-4x faster on CPU,
        and each row's result is bit-identical whatever the number of rows in the call.
        The embedding stays plain for the lookup."""
        pack = torch.ops.mkldnn._reorder_linear_weight
        for lw in self.layers:
            lw.qkv, lw.o, lw.gate_up, lw.down = pack(lw.qkv), pack(lw.o), pack(lw.gate_up), pack(lw.down)
        self.lm_head = pack(self.lm_head.clone() if self.lm_head is self.embed else self.lm_head)
        self._linear = _packed_linear

    def _small_matrices_transposed(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, transposed plain copies [in, out] of the matrices small enough that a plain
        matmul beats the packed kernel on one row (SINGLE_ROW_PLAIN_MAX_ELEMENTS). Taken before
        packing. Measured on float32 only, so used for float32 only."""
        small = [n for n in LayerKernels._fields
                 if getattr(self.layers[0], n).numel() <= SINGLE_ROW_PLAIN_MAX_ELEMENTS]
        return [{n: getattr(lw, n).t().contiguous() for n in small} for lw in self.layers]

    def _single_row_path(self, transposed: list[dict[str, torch.Tensor]]) -> FewRowPath:
        """The one-row passes: the transposed small matrices, the packed large ones and the
        norms shared with `self.layers`; the packed output layer."""
        plain = set(transposed[0])
        kernels = LayerKernels(*(_transposed_linear if n in plain else _packed_linear for n in LayerKernels._fields))
        layers = [LayerWeights(**{**vars(lw), **t}) for lw, t in zip(self.layers, transposed)]
        return FewRowPath(1, False, layers, kernels, self.lm_head, _packed_linear)

    def _int8_path(self) -> FewRowPath:
        """Passes of up to INT8_MAX_ROWS rows on int8 copies of every matmul weight (taken
        before packing), the output layer included."""
        layers = [LayerWeights(**{**vars(lw), **{n: quantize_int8(getattr(lw, n)) for n in LayerKernels._fields}})
                  for lw in self.layers]
        kernels = LayerKernels(*[int8_linear] * len(LayerKernels._fields))
        return FewRowPath(INT8_MAX_ROWS, False, layers, kernels, quantize_int8(self.lm_head), int8_linear)

    def _one_sequence_path(self, kernels: one_sequence.OneSequenceKernels) -> FewRowPath | None:
        """Passes over one sequence of up to ONE_SEQUENCE_MAX_TOKENS tokens, on the one-sequence
        kernel (taken before packing). A weight whose values are all bfloat16 values (a bf16
        checkpoint computed in float32) is kept in bfloat16: half the bytes to read, the same
        products. None if a weight does not suit the kernel."""
        weights = [{n: one_sequence.bf16_if_exact(getattr(lw, n)) for n in LayerKernels._fields} for lw in self.layers]
        head = one_sequence.bf16_if_exact(self.lm_head)
        if not all(one_sequence.supports(w) for w in [head, *(w for d in weights for w in d.values())]):
            return None
        layers = [LayerWeights(**{**vars(lw), **d}) for lw, d in zip(self.layers, weights)]
        kernel = kernels.linear
        return FewRowPath(ONE_SEQUENCE_MAX_TOKENS, True, layers, LayerKernels(*[kernel] * len(LayerKernels._fields)),
                          head, kernel)

    @property
    def num_parameters(self) -> int:
        return self._num_parameters

    def _count_parameters(self) -> int:
        tensors = [self.embed, self.final_norm] + [t for lw in self.layers for t in vars(lw).values()]
        if self.lm_head is not self.embed and not self.shape.tie_word_embeddings:
            tensors.append(self.lm_head)
        return sum(t.numel() for t in tensors)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:  # half precision: reduced in float32 inside the fused op
            return F.rms_norm(x, (x.shape[-1],), weight, eps=self.shape.rms_norm_eps)
        # float32: the same arithmetic (sum of squares, scale by 1/n, add eps, rsqrt, multiply)
        # as a few in-place ops, which on CPU cost about half of F.rms_norm's composite
        # (a draft decode step, with five norms, got ~8% faster); measured bit-identical to it
        # at hidden sizes 256, 512 and 4096, and each row's result is independent of the batch
        inv_rms = torch.mul(x, x).sum(-1, keepdim=True).mul_(1.0 / x.shape[-1]) \
            .add_(self.shape.rms_norm_eps).rsqrt_()  # [..., 1]
        return (x * inv_rms).mul_(weight)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """RoPE in the rotate-half convention; signed_sin carries the minus of the first half."""
        half = x.shape[-1] // 2
        swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
        return x * cos + swapped * signed_sin

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, heads, T, D], k/v [kv_heads, B, L, D], mask [B, 1, T, L] -> [B, heads, T, D]."""
        B, H, T, D = q.shape
        Hkv, L = k.shape[0], k.shape[2]
        if not _use_explicit_attention(B, T):
            return F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                                  scale=self.scale, enable_gqa=H != Hkv)
        # few queries per sequence (decode, speculative verify): two batched matmuls beat the
        # fused kernel on CPU. The query heads sharing a KV head are stacked as rows; the batch
        # runs over (kv_head, sequence), the order keys and values arrive in, so only the small
        # query and output tensors are reordered.
        G = H // Hkv
        qg = q.reshape(B, Hkv, G * T, D).transpose(0, 1)  # [kv_heads, B, group * T, D]
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * self.scale  # [kv_heads, B, group * T, L]
        if mask is not None:
            scores = scores.view(Hkv, B, G, T, L).masked_fill(~mask.unsqueeze(0), float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype).view(Hkv, B, G * T, L)
        out = torch.matmul(probs, v)  # [kv_heads, B, group * T, D]
        return out.transpose(0, 1).reshape(B, H, T, D)

    def _grouped_attention(self, q: torch.Tensor, kv: KVView, layer: int,
                           groups: list[AttentionGroup]) -> torch.Tensor:
        """q [B, heads, T, D] -> [B, heads, T, D], each group attending over its own keys."""
        if len(groups) == 1:
            keys, values = kv.read(layer, groups[0].read_rows)  # each [kv_heads, B, L, head_dim]
            return self._attention(q, keys, values, groups[0].mask)
        out = torch.empty_like(q)  # [B, heads, T, D]
        for g in groups:
            keys, values = kv.read(layer, g.read_rows)  # each [kv_heads, b, L_g, head_dim]
            out[g.index] = self._attention(q[g.index], keys, values, g.mask)
        return out

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
        if self._token_step is not None and self._token_step.takes(B, T, logits_index):
            return self._token_step.forward(input_ids, position_ids, kv, logits_index)
        h = F.embedding(input_ids, self.embed)  # [B, T, hidden]
        cos = self.cos[position_ids].unsqueeze(2)  # [B, T, 1, head_dim]
        sin = self.sin[position_ids].unsqueeze(2)  # [B, T, 1, head_dim]
        groups = kv.attention_groups(position_ids)  # who reads which keys, each with its mask
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        few = self._few_rows
        if few is not None and (B * T > few.max_rows or (few.one_sequence and B > 1)):
            few = None
        layers, mm = (self.layers, self._kernels) if few is None else (few.layers, few.kernels)
        for i, lw in enumerate(layers):
            x = self._rms_norm(h, lw.attn_norm)
            qkv = mm.qkv(x, lw.qkv)  # [B, T, q_size + 2 * kv_size]
            heads = s.num_heads + s.num_kv_heads
            qk = self._rotate(qkv[..., :q_size + kv_size].view(B, T, heads, s.head_dim), cos, sin)
            q, k = qk[:, :, :s.num_heads], qk[:, :, s.num_heads:]  # [B, T, heads|kv_heads, head_dim]
            v = qkv[..., q_size + kv_size:].view(B, T, s.num_kv_heads, s.head_dim)
            kv.write(i, k, v)
            attn = self._grouped_attention(q.transpose(1, 2), kv, i, groups)  # [B, heads, T, head_dim]
            h = h + mm.o(attn.transpose(1, 2).reshape(B, T, q_size), lw.o)
            x = self._rms_norm(h, lw.mlp_norm)
            gate, up = mm.gate_up(x, lw.gate_up).chunk(2, dim=-1)  # each [B, T, intermediate]
            h = h + mm.down(F.silu(gate) * up, lw.down)
        if logits_index is not None:
            h = h[torch.arange(B, device=h.device), logits_index]  # [B, hidden]
        h = self._rms_norm(h, self.final_norm)
        head, head_kernel = (self.lm_head, self._linear) if few is None else (few.lm_head, few.lm_head_kernel)
        logits = head_kernel(h, head).float()  # [B, (T,) vocab], or [B, (T,) V'] if restricted
        if self.output_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], s.vocab_size), float("-inf"))  # [B, (T,) vocab]
        return full.index_copy_(-1, self.output_ids, logits)
