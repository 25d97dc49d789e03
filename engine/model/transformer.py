"""The decoder-only transformer of the registered families (families.py), written against our
KV-cache views: RMSNorm, RoPE, grouped-query attention, the family's MLP, tied or untied
embeddings, and the per-family options of `ModelShape`; each layer's MLP is its own object (mlp.py). One functional code path serves prefill,
decode, chunked prefill and the verify pass; q/k/v and gate/up are fused so a layer is four
matmuls; which kernels a pass takes is the model's `ModelPlan`; which attention code, attention.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from engine.config import ModelPlan
from engine.kv.protocol import AttentionGroup, KVView
from engine.model.attention import CUDA_ATTENTION_BACKENDS, attend, attention_branch
from engine.model.kernels import fused, invariant, one_sequence
from engine.model.linears import any_linear, at_least_rows, onednn_reorders, reordered_linear
from engine.model.mlp import silu_mul
from engine.model.packing import Packing
from engine.model.paged_attention import PagedAttention, PagedMask
from engine.model.quant.linear import LinearParts, QuantLinear
from engine.model.shape import LayerWeights, ModelShape
from engine.model.token_step import TokenStep

ONE_SEQUENCE_MAX_TOKENS = 65  # a target's one-sequence passes up to this width take the kernel


class CapturedPassesLike(Protocol):
    """A model's captured passes (cuda_graphs.CapturedPasses), as passes.py replays them."""

    layers: tuple[int, ...]

    def run(self, ids, positions, view, extra): ...


MATMULS = ("qkv", "o", "gate_up", "down")  # the matmul weights of a layer
INVARIANT_RULES = ("onednn", "columns", "triton")  # make_row_invariant's kinds (invariance.py)


class OneSequencePath(NamedTuple):
    """What a target's passes over one sequence of at most ONE_SEQUENCE_MAX_TOKENS tokens multiply
    with: per-layer weights in column blocks for its kernel (norms shared), the kernel, the
    output layer."""

    layers: list[LayerWeights]  # matmul weights as one_sequence.ColumnBlocks
    kernel: Callable[[torch.Tensor, one_sequence.ColumnBlocks], torch.Tensor]
    lm_head: one_sequence.ColumnBlocks


class Transformer:
    """The forward over explicit weights. Thread-compatible, holds no per-request state."""

    attention_rule: str | None = None  # whose attention_branch rule to follow: "cpu", "cuda" (None: the device's)
    flash_gqa: bool | None = None  # flash attention takes this model's GQA inputs (None: probed at first use)
    last_attention_branches: tuple[str, ...] = ()  # the branch of each attention group in the last pass's first layer
    graphs: CapturedPassesLike | None = None  # its captured passes over its pool (engine/model/cuda_graphs.py), set at load
    paged: PagedAttention | None = None  # attention reading its pool in place (engine/model/paged_attention.py), set at load
    fused: bool = False  # each layer's pointwise work in fused kernels (engine/model/fused_check.py), set at load
    row_invariant: bool = False  # each row's bits independent of its pass (engine/model/invariance.py), set at load
    columns_always: bool = False  # every pass on the one-sequence path (its column-block kernel), under invariance
    invariant_rule: tuple[frozenset[int], str] | None = None  # make_row_invariant's arguments while on

    def __init__(self, shape: ModelShape, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, max_positions: int, plan: ModelPlan):
        """Weights arrive in the plan's dtype; a path the plan asks for that cannot run here is a
        ValueError."""
        self.shape = shape
        self.plan = plan
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.final_norm = final_norm  # [hidden]
        self.lm_head = lm_head  # [vocab, hidden] (the embedding itself when tied)
        self.dtype = embed.dtype
        self.device = embed.device
        self.cos, self.sin = shape.rope.tables(max_positions, self.dtype, self.device)  # [max_positions, head_dim]
        self.scale = shape.head_dim ** -0.5
        self.num_parameters = sum(t.numel() for t in self._weights())
        custom = [w for w in self._weights() if not isinstance(w, torch.Tensor)]  # quantized linears, experts
        for w in custom:  # each chooses how it runs on this device
            w.prepare(getattr(torch, plan.dtype))
        self.quantized = any(isinstance(w, (QuantLinear, LinearParts)) for w in custom)
        if custom and (plan.token_step or plan.one_sequence_kernel):
            raise ValueError("forward_plan: token_step and one_sequence_kernel run dense layers only, not a quantized "
                             "or mixture-of-experts checkpoint")
        if plan.token_step and not all(lw.mlp.dense for lw in layers):
            raise ValueError(f"forward_plan token_step: the C token step computes SwiGLU, not the "
                             f"{shape.model_type} family's own MLP")
        self._token_step = self._make_token_step() if plan.token_step else None
        # taken before the oneDNN reorder: it reads the plain weights
        self._one_sequence = self._one_sequence_path() if plan.one_sequence_kernel else None
        self._linear = any_linear(F.linear, self.quantized)
        # on CUDA, no cuDNN attention: its plans are cached by exact key length, new every decode step
        self._attention_backends = functools.partial(sdpa_kernel, CUDA_ATTENTION_BACKENDS) \
            if self.device.type == "cuda" else contextlib.nullcontext
        if self.device.type == "cpu" and onednn_reorders(self.dtype):
            self._reorder_for_onednn()
        self._plan_linear, self._plan_rule = self._linear, self.attention_rule  # make_row_invariant(None) restores them

    def make_row_invariant(self, pad_widths: frozenset[int] | None, kind: str = "onednn") -> None:
        """Every pass on a rule that keeps a row's bits independent of its pass (invariance.py), by
        `kind`: "onednn" (bf16 on CPU), fixed-order attention (grouped matmuls where the kernels
        cannot load) and one-row linears of `pad_widths` input features run as two rows; "columns"
        (float32 on CPU), every pass on the one-sequence path's column-block kernel with fixed-order
        attention (a ValueError where the kernels cannot run); "triton" (CUDA), dense linears and
        attention on kernels/invariant.py's fixed-tile, fixed-order kernels (a ValueError where a
        weight is not a dense tensor). None: back to the plan's paths."""
        if kind not in INVARIANT_RULES:
            raise ValueError(f"make_row_invariant: kind {kind!r} is none of {INVARIANT_RULES}")
        on = pad_widths is not None
        columns = kind == "columns"
        if columns and on and self._one_sequence is None:
            self._one_sequence = self._one_sequence_path()  # the plan did not take it: blocked now
        if kind == "triton" and on:
            linear = any_linear(self._dense_weights_linear(), self.quantized)
        elif on and not columns:
            linear = at_least_rows(self._plan_linear, pad_widths)
        else:
            linear = self._plan_linear
        self.columns_always = columns and on
        fixed_order = columns or self.device.type == "cpu" and one_sequence.load() is not None
        rule = "cuda_fixed_order" if kind == "triton" else "cpu_fixed_order" if fixed_order else "cpu_invariant"
        self.attention_rule = rule if on else self._plan_rule
        self._linear = linear
        self.row_invariant = on
        self.invariant_rule = (pad_widths, kind) if on else None

    def _dense_weights_linear(self) -> Callable:
        """kernels/invariant.py's dense linear, once every dense matmul weight is a plain tensor
        (as on CUDA; oneDNN's reordered CPU weights are not): a ValueError naming one that is not."""
        for name, w in [("lm_head", self.lm_head)] + [(n, getattr(lw, n)) for lw in self.layers for n in MATMULS]:
            if isinstance(w, torch.Tensor) and (w.is_mkldnn or w.layout != torch.strided):
                raise ValueError(f"batch_invariant's CUDA rule multiplies plain dense weights; {name} is laid out "
                                 f"for oneDNN")
        return invariant.dense_linear

    def linear_probe(self, columns: bool = False) -> tuple[Callable, list, list[int]]:
        """(this model's linear, a weight of each matmul and the output layer, their input widths),
        for invariance.linear_rows_rule; columns: the column-block kernel's (the one-sequence path's);
        experts are left out (torch's grouped matmuls, not ours)."""
        s = self.shape
        widths = {"qkv": s.hidden_size, "o": s.num_heads * s.head_dim, "gate_up": s.hidden_size,
                  "down": s.intermediate_size}
        linear, layers, head = (self._one_sequence.kernel, self._one_sequence.layers, self._one_sequence.lm_head) \
            if columns else (self._linear, self.layers, self.lm_head)
        weights, ins = [head], [s.hidden_size]
        for name, k in widths.items():
            w = next((getattr(lw, name) for lw in layers if getattr(lw, name) is not None), None)
            if w is not None:
                weights.append(w)
                ins.append(k)
        return linear, weights, ins

    def _make_token_step(self) -> TokenStep:
        return TokenStep(self.shape, self.embed, self.layers, self.final_norm, self.lm_head, self.cos, self.sin,
                         self.plan.token_step_rows)

    @property
    def token_step(self) -> TokenStep | None:
        """The whole-model C step of narrow passes, when the plan has it."""
        return self._token_step

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take on the device (quantized linears as stored, with their scales)."""
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes for t in self._weights())

    @property
    def weight_format(self) -> str:
        """What the weights are stored as: the dtype, with the quantized linears' forms."""
        forms = sorted({w.form for w in self._weights() if isinstance(w, (QuantLinear, LinearParts))})
        return " + ".join([*forms, str(self.dtype).removeprefix("torch.")])

    def _weights(self) -> list[torch.Tensor]:
        tensors = [self.embed, self.final_norm] + [t for lw in self.layers for t in lw.tensors()]
        return tensors + ([] if self.lm_head is self.embed else [self.lm_head])

    def _one_sequence_path(self) -> OneSequencePath:
        """Passes over one sequence of up to ONE_SEQUENCE_MAX_TOKENS tokens on the column-block
        kernel (weights laid out in column blocks for it); a weight whose values are all bf16 values is
        kept in bf16 (half the bytes). A bf16 model's one-sequence passes run in float32 throughout
        (`_run`), their K/V stored in the pool's bf16."""
        kernels = one_sequence.load() if self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16) \
            else None
        if kernels is None:
            raise ValueError("forward_plan one_sequence_kernel: the kernel cannot run here (it needs float32 or bf16 "
                             "on an x86-64 CPU with AVX2 and FMA, and the kernels built)")
        def columns(w):  # reordered for oneDNN already where the plan did not take this path (make_row_invariant)
            return one_sequence.to_column_blocks(one_sequence.bf16_if_exact(w.to_dense() if w.is_mkldnn else w))
        blocked = [{n: columns(getattr(lw, n)) for n in MATMULS} for lw in self.layers]
        layers = [LayerWeights(**{**vars(lw), **d}) for lw, d in zip(self.layers, blocked)]
        head = columns(self.lm_head)
        return OneSequencePath(layers, kernels.column_linear, head)

    def _reorder_for_onednn(self) -> None:
        """Re-lays the matmul weights out for oneDNN: small-batch matmuls faster, and each row's
        result bit-identical whatever the number of rows. The embedding stays plain."""
        def reorder(w):  # a quantized linear keeps its own form
            return torch.ops.mkldnn._reorder_linear_weight(w) if isinstance(w, torch.Tensor) else w
        for lw in self.layers:
            lw.qkv, lw.o, lw.gate_up, lw.down = reorder(lw.qkv), reorder(lw.o), reorder(lw.gate_up), reorder(lw.down)
            lw.mlp.reorder(reorder)
        self.lm_head = reorder(self.lm_head.clone() if self.lm_head is self.embed else self.lm_head)
        self._linear = any_linear(reordered_linear, self.quantized)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dimension; weight [last] or, per head, [heads, last]."""
        if x.dtype != torch.float32:  # half precision: reduced in float32 inside the fused op
            if weight.dim() > 1:
                return F.rms_norm(x, (x.shape[-1],), eps=self.shape.rms_norm_eps) * weight
            return F.rms_norm(x, (x.shape[-1],), weight, eps=self.shape.rms_norm_eps)
        # float32: F.rms_norm's arithmetic as in-place ops, bit-identical and cheaper on CPU
        # (docs/performance-notes.md#rms-norm); each row independent of the batch
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
                   mask: torch.Tensor | None, branch: str | None = None) -> torch.Tensor:
        """attention.attend under this model's scale; branch None: the CPU rule's, for a general mask."""
        if branch is None:
            B, H, T, _ = q.shape
            rule = self.attention_rule if self.row_invariant else "cpu"
            branch = attention_branch(rule, B, T, k.shape[2], H, k.shape[0], "none" if mask is None else "general")
        return attend(q, k, v, mask, branch, self.scale)

    def _attention_branch(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                          causal_tail: bool) -> str:
        """attention_branch for q [B, heads, T, D] over k [kv_heads, B, L, D] under this model's
        rule; causal_tail: the view says its mask is lower-right causal."""
        B, H, T, _ = q.shape
        Hkv, L = k.shape[0], k.shape[2]
        if q.dtype != k.dtype:  # a bf16 model's float32 one-sequence pass: the kernel reads the bf16 K/V as they are
            return "fixed_order"
        kind = "none" if mask is None else "causal_tail" if causal_tail else "general"
        rule = self.attention_rule or self.device.type
        flash = rule == "cuda" and kind == "causal_tail" and H != Hkv and self._flash_takes_gqa(q, k)
        return attention_branch(rule, B, T, L, H, Hkv, kind, flash)

    def _flash_takes_gqa(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether flash attention takes this model's queries and K/V heads with enable_gqa and no
        mask (dtype, head_dim, GPU, backends enabled), asked of torch once; False where it cannot say."""
        if self.flash_gqa is None:
            keys = k.transpose(0, 1)  # [B, kv_heads, L, D]
            try:
                params = torch.backends.cuda.SDPAParams(q, keys, keys, None, 0.0, False, True)
                self.flash_gqa = q.device.type == "cuda" and torch.backends.cuda.can_use_flash_attention(params)
            except (AttributeError, RuntimeError, TypeError):
                self.flash_gqa = False
        return self.flash_gqa

    def _attention_inputs(self, kv: KVView, position_ids: torch.Tensor) -> list[AttentionGroup] | PagedMask:
        """Who reads which keys, once per pass: the block mask where this pass reads the pool in
        place (never under row-count invariance: the in-place kernel is not fixed-order), else the
        view's groups (each gathers its keys) with their masks."""
        if self.paged is not None and not self.row_invariant and self.paged.takes(position_ids.shape[1], kv):
            return self.paged.mask(kv, position_ids)
        return kv.attention_groups(position_ids)

    def _grouped_attention(self, q: torch.Tensor, kv: KVView, layer: int,
                           groups: list[AttentionGroup] | PagedMask) -> torch.Tensor:
        """q [B, heads, T, D] -> [B, heads, T, D], each group attending over its own keys (or every
        sequence over its blocks in place). A view whose `causal_tail` is True (absent: False) says
        its mask is lower-right causal: every row's T queries are exactly its last T keys (no
        padding rows, no keys past the row's end)."""
        if isinstance(groups, PagedMask):
            if layer == 0:
                self.last_attention_branches = ("inplace",)
            return self.paged.attend(q, kv.storage[layer], groups, self.scale)
        causal_tail = len(groups) == 1 and getattr(kv, "causal_tail", False)
        if len(groups) == 1:
            keys, values = kv.read(layer, groups[0].read_rows)  # each [kv_heads, B, L, head_dim]
            branch = self._attention_branch(q, keys, groups[0].mask, causal_tail)
            if layer == 0:
                self.last_attention_branches = (branch,)
            return self._attention(q, keys, values, groups[0].mask, branch)
        out = torch.empty_like(q)  # [B, heads, T, D]
        branches = []
        for g in groups:
            keys, values = kv.read(layer, g.read_rows)  # each [kv_heads, b, L_g, head_dim]
            qg = q[g.index]  # [b, heads, T, D]
            branches.append(self._attention_branch(qg, keys, g.mask, False))
            out[g.index] = self._attention(qg, keys, values, g.mask, branches[-1])
        if layer == 0:
            self.last_attention_branches = tuple(branches)
        return out

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVView,
                logits_index: torch.Tensor | None = None, packing: Packing | None = None) -> torch.Tensor:
        """Runs the model on new tokens, writing their K/V through `kv`.

        input_ids, position_ids: [B, T] (padded rows carry position 0 and are written to the
        view's scratch row). logits_index: [B] index along T whose logits to return (decode /
        last prefill token) or None for all positions (speculative verify).
        packing (with logits_index None): the linears compute only its real tokens (packing.py;
        not in the token step, whose passes are narrow).
        Returns logits [B, vocab] or [B, T, vocab] (float32; a packed pass's padding: zeros).
        """
        B, T = input_ids.shape
        if self._token_step is not None and self._token_step.takes(B, T, logits_index):  # padded or not: its own kernel
            return self._token_step.forward(input_ids, position_ids, kv, logits_index)
        return self._run(input_ids, position_ids, kv, logits_index, (), packing)[0]

    @torch.inference_mode()
    def forward_features(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVView,
                         logits_index: torch.Tensor | None, layers: tuple[int, ...],
                         packing: Packing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's logits, and the inputs of `layers` side by side at every position
        [B, T, len(layers) * hidden] (the features an EAGLE-3 head reads)."""
        return self._run(input_ids, position_ids, kv, logits_index, layers, packing)

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVView, logits_index: torch.Tensor | None,
             capture: tuple[int, ...], packing: Packing | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder, one loop for every path: each layer's attention and MLP, each after the
        residual add and the norm before it (`add_norm`); the pointwise work in the fused
        kernels (kernels/fused.py: the add and norm, q/k norm + RoPE + the K/V write,
        SiLU-and-multiply) where they are on and the pass is not the one-sequence kernel's."""
        B, T = input_ids.shape
        # the column-block kernel: the plan's one-sequence passes (not on the bf16 rule: oneDNN only), or the float32 rule's
        one_sequence = B == 1 and T <= ONE_SEQUENCE_MAX_TOKENS and not self.row_invariant
        few = self._one_sequence if self.columns_always or one_sequence else None
        layers, linear, head = (self.layers, self._linear, self.lm_head) if few is None else \
            (few.layers, few.kernel, few.lm_head)
        groups = self._attention_inputs(kv, position_ids)  # who reads which keys, each with its mask
        wide = few is not None and self.dtype != torch.float32  # a bf16 model's one-sequence pass: float32 throughout
        if self.fused and few is None:
            add_norm = functools.partial(fused.add_rms_norm, eps=self.shape.rms_norm_eps)
            final_norm = self.final_norm  # normed with the last add, every row

            def attention(y, lw, i):
                return self._fused_attention(y, lw, kv, i, groups, position_ids, packing)

            act = fused.silu_mul
        else:
            add_norm, final_norm = self._add_norm, None  # the final norm after the logits' rows are picked
            rope = self.cos[position_ids].unsqueeze(2), self.sin[position_ids].unsqueeze(2)  # [B, T, 1, head_dim] each
            if wide:
                rope = rope[0].float(), rope[1].float()

            def attention(y, lw, i):
                return self._attention_block(y, lw, linear, rope, kv, i, groups, packing)

            act = silu_mul
        h = F.embedding(input_ids, self.embed)  # [B, T, hidden]
        if wide:
            h = h.float()
        if packing is not None:
            h = packing.take(h)  # [N, hidden]
        h, y = add_norm(h, None, layers[0].attn_norm)  # the residual stream, and its normed input to the next block
        captured = {}  # layer -> its input
        with self._attention_backends():
            for i, lw in enumerate(layers):
                if i in capture:
                    captured[i] = h.to(self.dtype)
                h, y = add_norm(attention(y, lw, i), h, lw.mlp_norm)
                h, y = add_norm(lw.mlp(y, lw, linear, act), h, layers[i + 1].attn_norm if i + 1 < len(layers) else final_norm)
        if final_norm is None:
            if logits_index is not None:
                h = h[torch.arange(B, device=h.device), logits_index]  # [B, hidden]
            y = self._rms_norm(h, self.final_norm)
        elif logits_index is not None:
            y = y[torch.arange(B, device=y.device), logits_index]  # [B, hidden]
        logits = linear(y, head).float()  # [B, (T,) vocab] ([N, vocab] packed)
        return _outputs(logits, captured, capture, packing)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                  weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual + x, its RMSNorm by weight): fused.add_rms_norm's contract in plain ops (no
        residual: x itself; no weight: no norm)."""
        h = x if residual is None else residual + x
        return h, None if weight is None else self._rms_norm(h, weight)

    def _fused_attention(self, x: torch.Tensor, lw: LayerWeights, kv: KVView, i: int,
                         groups: list[AttentionGroup] | PagedMask, position_ids: torch.Tensor,
                         packing: Packing | None = None) -> torch.Tensor:
        """Self-attention of layer i over its normed input x [B, T, hidden] -> [B, T, hidden], q/k's
        norm, RoPE and the K/V write in one kernel (packed: x and the output [N, hidden])."""
        s = self.shape
        qkv = self._linear(x, lw.qkv)  # [B, T, q_size + 2 * kv_size]
        if lw.qkv_bias is not None:
            qkv += lw.qkv_bias
        if packing is not None:
            qkv = packing.spread(qkv)
        B, T = qkv.shape[:2]
        q = fused.rope_qk_write(qkv.contiguous(), position_ids, self.cos, self.sin, lw.qk_norm, kv.storage[i],
                                kv.write_rows, s.num_heads, s.num_kv_heads, s.rms_norm_eps)  # [B, T, heads, D]
        attn = self._grouped_attention(q.transpose(1, 2), kv, i, groups)  # [B, heads, T, D]
        attn = attn.transpose(1, 2).reshape(B, T, s.num_heads * s.head_dim)
        out = self._linear(attn if packing is None else packing.take(attn), lw.o)  # [B, T, hidden] ([N, hidden])
        return out if lw.o_bias is None else out.add_(lw.o_bias)

    def _attention_block(self, x: torch.Tensor, lw: LayerWeights, linear: Callable,
                         rope: tuple[torch.Tensor, torch.Tensor], kv: KVView, i: int,
                         groups: list[AttentionGroup] | PagedMask, packing: Packing | None = None) -> torch.Tensor:
        """Self-attention of layer i over its normed input x [B, T, in] -> [B, T, hidden],
        writing the layer's K/V (packed: x and the output [N, ...])."""
        s = self.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qkv = linear(x, lw.qkv)  # [B, T, q_size + 2 * kv_size]
        if lw.qkv_bias is not None:
            qkv += lw.qkv_bias
        if packing is not None:
            qkv = packing.spread(qkv)
        B, T = qkv.shape[:2]
        qk = qkv[..., :q_size + kv_size].view(B, T, s.num_heads + s.num_kv_heads, s.head_dim)
        qk = self._rotate(qk if lw.qk_norm is None else self._rms_norm(qk, lw.qk_norm), *rope)
        q, k = qk[:, :, :s.num_heads], qk[:, :, s.num_heads:]  # [B, T, heads|kv_heads, head_dim]
        kv.write(i, k, qkv[..., q_size + kv_size:].view(B, T, s.num_kv_heads, s.head_dim))
        attn = self._grouped_attention(q.transpose(1, 2), kv, i, groups).transpose(1, 2).reshape(B, T, q_size)
        out = linear(attn if packing is None else packing.take(attn), lw.o)  # [B, T, hidden] ([N, hidden])
        return out if lw.o_bias is None else out.add_(lw.o_bias)

    def _mlp_block(self, h: torch.Tensor, lw: LayerWeights, linear: Callable) -> torch.Tensor:
        """The layer's MLP of the residual stream h [B, T, hidden] (its norm included)."""
        return lw.mlp(self._rms_norm(h, lw.mlp_norm), lw, linear, silu_mul)


def _outputs(logits: torch.Tensor, captured: dict[int, torch.Tensor], capture: tuple[int, ...],
             packing: Packing | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, the captured layers' inputs side by side), spread back to [B, T, ...] when packed."""
    features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
    if packing is None:
        return logits, features
    return packing.spread(logits), None if features is None else packing.spread(features)
