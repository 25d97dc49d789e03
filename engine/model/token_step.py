"""A draft model's narrow passes as whole-model C calls (token_step.c): the pass's rows (a few
tokens of one or more sequences) go through each matmul together, every row writes its K/V through
the pass's view before any attends, so a pass gives the torch forward's K/V and logits up to
rounding. An EAGLE-3 head's passes run the same way (`head_pass`). Only proposers use it: their
rounding may differ between passes.
"""

from __future__ import annotations

import ctypes
import enum

import torch

from engine.config import ModelPlan
from engine.kv.protocol import KVView
from engine.model.kernels import one_sequence

# the widest passes a model's token step may take (the plan's default first); its plan measures which (performance-notes)
TOKEN_STEP_ROWS = (ModelPlan.token_step_rows, 16)


class WeightKind(enum.IntEnum):  # token_step.c's enum WeightKind
    F32 = 0
    BF16 = 1


class _Layer(ctypes.Structure):  # token_step.c's StepLayer
    _fields_ = [("attn_norm", ctypes.c_void_p), ("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p),
                ("mlp_norm", ctypes.c_void_p), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p)]


class _Model(ctypes.Structure):  # token_step.c's StepModel
    _fields_ = [("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("layers", ctypes.c_int64),
                ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("head_rows", ctypes.c_int64), ("kv_rows", ctypes.c_int64), ("max_keys", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("kind", ctypes.c_int64),
                ("kv_kind", ctypes.c_int64), ("embed", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p), ("hidden_norm", ctypes.c_void_p), ("lm_head", ctypes.c_void_p),
                ("layer", ctypes.POINTER(_Layer)), ("kv", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
                ("max_rows", ctypes.c_int64), ("norm_before_residual", ctypes.c_int64)]


class _Row(ctypes.Structure):  # token_step.c's StepRow
    _fields_ = [("token", ctypes.c_int64), ("pos", ctypes.c_int64), ("write_row", ctypes.c_int64),
                ("first_key_row", ctypes.c_int64), ("key_rows", ctypes.c_void_p)]


class TokenStep:
    """The C step's model struct, pointing at the weights (kept alive here) of a float32 or bf16 CPU
    model, whose dtype the KV cache shares (a float32 model's matmuls read bf16 copies when its
    weights' values are all bf16); ValueError where it cannot run. It takes passes of at most
    `max_rows` tokens. `hidden_norm`: an EAGLE-3 head's, whose residual is the normed hidden state
    when `norm_before_residual` (else the hidden state)."""

    def __init__(self, shape, embed: torch.Tensor, layers: list, final_norm: torch.Tensor, lm_head: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, max_rows: int, hidden_norm: torch.Tensor | None = None,
                 norm_before_residual: bool = False):
        tensors = [embed, final_norm, lm_head, cos, sin] + [t for lw in layers for t in lw.tensors()]
        self._kernels = one_sequence.load()
        if not self.runs(shape) or any(t.device.type != "cpu" or t.dtype != embed.dtype for t in tensors) \
                or embed.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("forward_plan token_step: the CPU token step cannot run here (it needs float32 or "
                             "bfloat16 weights on an x86-64 CPU with AVX2, widths that are multiples of 8, no "
                             "attention biases or q/k norms, and the kernels built)")
        self.dtype = embed.dtype  # of the KV storage it reads and writes
        self.max_rows = max_rows
        cos, sin, final_norm = cos.float(), sin.float(), final_norm.float()
        layers = [type(lw)(**{**vars(lw), "attn_norm": lw.attn_norm.float(), "mlp_norm": lw.mlp_norm.float()})
                  for lw in layers]
        self._keep: list[torch.Tensor] = []  # every tensor whose pointer the C struct holds
        matrices = [[getattr(lw, n) for n in ("qkv", "o", "gate_up", "down")] for lw in layers] + [[lm_head]]
        narrowed = [[one_sequence.bf16_if_exact(w) for w in ws] for ws in matrices]
        kind = WeightKind.BF16 if all(w.dtype == torch.bfloat16 for ws in narrowed for w in ws) else WeightKind.F32
        if kind == WeightKind.F32:  # one dtype for every matmul weight
            narrowed = [[w.contiguous() for w in ws] for ws in matrices]
        weights = [[self._held(w) for w in ws] for ws in narrowed]
        self._layers = (_Layer * len(layers))(*[
            _Layer(self._held(lw.attn_norm.contiguous()), qkv, o, self._held(lw.mlp_norm.contiguous()), gate_up, down)
            for lw, (qkv, o, gate_up, down) in zip(layers, weights)])
        self._model = _Model(
            hidden=shape.hidden_size, intermediate=shape.intermediate_size, layers=len(layers), heads=shape.num_heads,
            kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, head_rows=lm_head.shape[0], kv_rows=0,
            max_keys=cos.shape[0], eps=shape.rms_norm_eps, scale=shape.head_dim ** -0.5, kind=int(kind),
            kv_kind=int(WeightKind.BF16 if self.dtype == torch.bfloat16 else WeightKind.F32),
            embed=self._held(embed.contiguous()), cos=self._held(cos.contiguous()), sin=self._held(sin.contiguous()),
            final_norm=self._held(final_norm.contiguous()), lm_head=weights[-1][0], layer=self._layers, kv=None,
            scratch=None, hidden_norm=None if hidden_norm is None else self._held(hidden_norm.float().contiguous()),
            max_rows=max_rows, norm_before_residual=int(norm_before_residual))
        floats = self._kernels.token_step_scratch_floats(ctypes.byref(self._model), self._model.max_keys)
        self._model.scratch = self._held(torch.empty(floats, dtype=torch.float32))  # the C step's workspace
        self._vocab_size = lm_head.shape[0]  # the row stride of the logits the C step writes

    @staticmethod
    def runs(shape) -> bool:
        """Whether a model of this shape can take token steps (dtype and device aside)."""
        widths = (shape.hidden_size, shape.intermediate_size, shape.num_heads * shape.head_dim, shape.head_dim)
        return one_sequence.load() is not None and not any(w % 8 for w in widths) \
            and not shape.num_heads % shape.num_kv_heads and not (shape.qkv_bias or shape.o_bias or shape.qk_norm)

    def _held(self, t: torch.Tensor) -> int:
        self._keep.append(t)
        return t.data_ptr()

    def takes(self, batch: int, width: int, logits_index: torch.Tensor | None) -> bool:
        """Whether a pass of `batch` x `width` query rows computes at most max_rows tokens
        (each sequence's up to logits_index[b]; every row when it is None)."""
        if logits_index is None:
            return batch * width <= self.max_rows
        return batch + int(logits_index.sum()) <= self.max_rows

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVView,
                logits_index: torch.Tensor | None) -> torch.Tensor:
        """As Transformer.forward for a pass over B sequences of T query rows, computing only each
        sequence's tokens up to logits_index[b] (all T rows are real when it is None). Returns
        logits [B, vocab] (or [B, T, vocab] when logits_index is None), float32."""
        B, T = input_ids.shape
        rows, outs = self._rows(input_ids, position_ids, kv, logits_index)
        logits = torch.empty(len(outs), self._vocab_size, dtype=torch.float32)  # [B or B * T, vocab]
        out_rows = torch.tensor(outs, dtype=torch.int64)
        _check(self._kernels.token_rows(ctypes.byref(self._model), rows, len(rows), out_rows.data_ptr(), len(outs),
                                        logits.data_ptr(), torch.get_num_threads()))
        return logits if logits_index is not None else logits.view(B, T, self._vocab_size)

    def head_pass(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVView, hidden: torch.Tensor,
                  logits_index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """An EAGLE-3 head's pass (input_ids, position_ids [B, T]) fed hidden states [B, T, hidden]
        (fused target features, or its previous outputs): logits float32 and the pass's outputs in
        hidden's dtype, [B, vocab] and [B, hidden] at logits_index (every row, [B, T, ...], when None)."""
        B, T = input_ids.shape
        rows, outs = self._rows(input_ids, position_ids, kv, logits_index)
        counts = [T] * B if logits_index is None else [i + 1 for i in logits_index.tolist()]
        state = torch.cat([hidden[b, :n] for b, n in enumerate(counts)]).to(torch.float32).contiguous()  # [rows, H]
        logits = torch.empty(len(outs), self._vocab_size, dtype=torch.float32)  # [B or B * T, vocab]
        out_rows = torch.tensor(outs, dtype=torch.int64)
        _check(self._kernels.eagle_rows(ctypes.byref(self._model), rows, len(rows), state.data_ptr(),
                                        out_rows.data_ptr(), len(outs), logits.data_ptr(), torch.get_num_threads()))
        state = state[out_rows].to(hidden.dtype)  # [B or B * T, hidden]
        if logits_index is None:
            return logits.view(B, T, -1), state.view(B, T, -1)
        return logits, state

    def draft(self, first: list[int], kv: KVView, positions: list[int], steps: int, hidden: torch.Tensor | None,
              draft_to_target: torch.Tensor | None, candidates: int | None = None,
              temperatures: torch.Tensor | None = None,
              uniforms: torch.Tensor | None = None) -> tuple[list[list[int]], torch.Tensor | None]:
        """Drafting in one C call: for each sequence b, `steps` tokens after first[b] (fed at
        positions[b]), each picked from the step's first `candidates` logits (all by default) and
        fed to the next, as target ids through draft_to_target [draft_vocab] when given. Greedy
        (the argmax) unless temperatures [B] float32 is given: then row b with temperatures[b] > 0
        draws step j from q = softmax(logits / temperatures[b]) at uniforms [B, steps][b, j]
        (inverse CDF), a row at 0 takes the argmax (q one-hot). kv: a view of `steps` new positions
        of each sequence (a pass of [B, steps] tokens). hidden [B, hidden]: an EAGLE-3 head's state
        for the first step (its outputs after, float32, updated in place); None for a draft model.
        Returns the tokens [B][steps] and, when temperatures is given, q [B, steps, candidates]
        (indexed by draft id, before draft_to_target)."""
        B = len(first)
        if B > self.max_rows:
            raise ValueError(f"TokenStep.draft takes at most {self.max_rows} sequences, got {B}")
        if hidden is not None and (hidden.dtype != torch.float32 or not hidden.is_contiguous()):
            raise ValueError("TokenStep.draft needs a contiguous float32 hidden state")
        candidates = self._vocab_size if candidates is None else candidates
        q = None
        if temperatures is not None:
            if temperatures.shape != (B,) or uniforms is None or uniforms.shape != (B, steps):
                raise ValueError(f"TokenStep.draft needs temperatures [{B}] and uniforms [{B}, {steps}] together")
            temperatures = temperatures.to(torch.float32).contiguous()
            uniforms = uniforms.to(torch.float32).contiguous()
            q = torch.empty(B, steps, candidates, dtype=torch.float32)
        ids = torch.tensor(first, dtype=torch.int64)[:, None].expand(B, steps)  # [B, steps]: only column 0 is read
        pos = torch.tensor(positions, dtype=torch.int64)[:, None] + torch.arange(steps)  # [B, steps]
        rows, _ = self._rows(ids, pos, kv, None, max_rows=B * steps)
        firsts = (_Row * B)(*[rows[b * steps] for b in range(B)])
        write_rows = torch.tensor([r.write_row for r in rows], dtype=torch.int64)  # [B * steps]
        tokens = torch.empty(B, steps, dtype=torch.int64)
        logits = torch.empty(B, self._vocab_size, dtype=torch.float32)  # [B, vocab] scratch
        mapping = None if draft_to_target is None else draft_to_target.to(torch.int64).contiguous()
        _check(self._kernels.draft_rows(ctypes.byref(self._model), firsts, B, _ptr(hidden), steps, write_rows.data_ptr(),
                                        _ptr(mapping), candidates, _ptr(temperatures), _ptr(uniforms), tokens.data_ptr(),
                                        _ptr(q), logits.data_ptr(), torch.get_num_threads()))
        return tokens.tolist(), q

    def _rows(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVView,
              logits_index: torch.Tensor | None, max_rows: int | None = None) -> tuple[ctypes.Array, list[int]]:
        """Points the C model at the view's storage; the pass's rows (each sequence's tokens up to
        logits_index[b], every row when None) and the indices among them whose logits are wanted."""
        B, T = input_ids.shape
        counts = [T] * B if logits_index is None else [i + 1 for i in logits_index.tolist()]
        max_rows = self.max_rows if max_rows is None else max_rows
        if sum(counts) > max_rows:
            raise ValueError(f"TokenStep takes passes of at most {max_rows} rows, got {sum(counts)}")
        storage = kv.storage  # [layers, 2, kv_heads, rows, head_dim]
        if storage.dtype != self.dtype or not storage.is_contiguous() or storage.device.type != "cpu":
            raise ValueError(f"TokenStep needs a contiguous {self.dtype} CPU KV storage")
        ids, positions, write_rows = input_ids.tolist(), position_ids.tolist(), kv.write_rows.tolist()
        if max(positions[b][n - 1] for b, n in enumerate(counts)) >= self._model.max_keys:
            raise ValueError(f"position exceeds the model's {self._model.max_keys} positions")
        self._model.kv = storage.data_ptr()
        self._model.kv_rows = storage.shape[3]
        if kv.mask_override is not None:  # a tree pass: each query row has its own keys
            read = kv.read_rows.to(torch.int64) if kv.read_rows is not None else torch.arange(
                kv.read_slice.start, kv.read_slice.stop, dtype=torch.int64)[None]  # [B or 1, L]
            self._key_rows = _tree_key_rows(read, kv.mask_override, position_ids, kv.last)  # [B, T, L]
            keys = [[(self._key_rows[b, t].data_ptr(), 0) for t in range(T)] for b in range(B)]
        elif kv.read_rows is None:  # one sequence whose keys are one slice of storage
            keys = [[(None, kv.read_slice.start)] * T]
        else:
            self._key_rows = kv.read_rows.to(torch.int64).contiguous()  # [B, L], alive while the pass runs
            keys = [[(r.data_ptr(), 0)] * T for r in self._key_rows]
        rows, outs = [], []
        for b, n in enumerate(counts):
            rows += [_Row(ids[b][t], positions[b][t], write_rows[b * T + t], keys[b][t][1], keys[b][t][0])
                     for t in range(n)]
            outs += range(len(rows) - n, len(rows)) if logits_index is None else [len(rows) - 1]
        return (_Row * len(rows))(*rows), outs


def _tree_key_rows(read: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                   last: torch.Tensor) -> torch.Tensor:
    """[B, T, L] storage rows of the keys each query of a tree pass sees (kv/tree_view.py), in
    position order, first: the C step reads the first position + 1 of them (a query sees the
    context, the root and its own ancestors: position + 1 keys). read [B, L] (or [1, L]) each key
    position's row; mask [B, 1, T, L]; positions [B, T]; last [B] each chunk's last query."""
    visible = mask[:, 0]  # [B, T, L]
    B, T, L = visible.shape
    order = visible.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)  # [B, T, L] visible keys first
    counts = visible.sum(-1)  # [B, T]
    real = torch.arange(T)[None, :] <= last[:, None]  # [B, T] the chunks' queries (padding reads its first key)
    if not bool(torch.where(real, counts == positions + 1, counts >= 1).all()):
        raise ValueError("a tree pass's mask must show each query exactly position + 1 keys")
    return read.expand(B, L).gather(1, order.view(B, T * L)).view(B, T, L).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for ctypes, NULL for None."""
    return None if t is None else t.data_ptr()


def _check(status: int) -> None:
    if status:
        raise ValueError("token step rejected a position or KV row of its pass")
