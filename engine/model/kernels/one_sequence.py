"""The hand-written CPU kernels: the one-sequence matmuls (one_sequence.c over weights that stay
in cache, a proposer's; column_blocks.c over weights streamed from memory, a target's) and a
draft's whole token step (token_step.c), compiled with the system C compiler on first use into
one cached library and loaded with ctypes; None (logged once) where that cannot happen.

`linear(x, weight)` and `column_linear(x, to_column_blocks(weight))` are x [..., in] @ weight.T for
weights [out, in] in float32 or bfloat16, each row's bits independent of the number of rows (the
C files say why; the two kernels sum in different orders, so their bits differ).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("one_sequence.c", "column_blocks.c", "token_step.c", "fixed_order_attention.c")]
HEADERS = [Path(__file__).with_name("row_groups.h")]  # included by the sources: part of the digest, not compiled alone
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
COLUMN_BLOCK = 16  # output columns per block of a blocked weight (column_blocks.c)


class ColumnBlocks(NamedTuple):
    """A weight [out, in] laid out in column blocks for column_blocks.c (its comment gives the layout)."""

    blocks: torch.Tensor  # [ceil(out / 16), in, 16] float32 or bfloat16; past `out`, zeros
    out_features: int


def to_column_blocks(weight: torch.Tensor) -> ColumnBlocks:
    """weight [out, in] (float32 or bfloat16, CPU) in blocks of 16 output columns; in bfloat16, the
    columns of a block in the order 0, 8, 1, 9, ..., 7, 15, so the 32-bit word j holds columns j
    (low half) and j + 8 (high half)."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"to_column_blocks takes a 2-D float32 or bfloat16 CPU weight, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    out_features, in_features = weight.shape
    pad = -out_features % COLUMN_BLOCK
    padded = torch.cat([weight, weight.new_zeros(pad, in_features)]) if pad else weight
    blocks = padded.reshape(-1, COLUMN_BLOCK, in_features).transpose(1, 2)  # [blocks, in, 16]
    if weight.dtype == torch.bfloat16:
        half = COLUMN_BLOCK // 2
        blocks = blocks[..., [c for j in range(half) for c in (j, j + half)]]
    return ColumnBlocks(blocks.contiguous(), out_features)


class OneSequenceKernels:
    """The compiled kernels: the matmul for float32 and bfloat16 weights, and the token step's passes."""

    def __init__(self, lib: ctypes.CDLL):
        self.f32 = lib.one_sequence_f32
        self.bf16 = lib.one_sequence_bf16
        self.column_f32 = lib.column_blocks_f32
        self.column_bf16 = lib.column_blocks_bf16
        for fn in (self.f32, self.bf16, self.column_f32, self.column_bf16):
            # (w, x, y, N, K, M, threads)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
            fn.restype = None
        # token_rows(model*, rows*, n, out_rows*, n_out, logits*, threads)
        self.token_rows = lib.token_rows
        self.token_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        self.token_rows.restype = ctypes.c_int
        # eagle_rows(model*, rows*, n, hidden*, out_rows*, n_out, logits*, threads)
        self.eagle_rows = lib.eagle_rows
        self.eagle_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        self.eagle_rows.restype = ctypes.c_int
        # draft_rows(model*, rows*, n, hidden*, steps, write_rows*, draft_to_target*, candidates, temperatures*,
        #            uniforms*, tokens*, q*, logits*, threads)
        self.draft_rows = lib.draft_rows
        self.draft_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self.draft_rows.restype = ctypes.c_int
        # fixed_order_attention(q*, k*, v*, kv_bf16, visible*, out*, B, H, Hkv, T, L, D, head_stride, batch_stride,
        #                       scale, threads)
        self._attention = lib.fixed_order_attention
        self._attention.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + \
            [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int]
        self._attention.restype = ctypes.c_int
        self.token_step_scratch_floats = lib.token_step_scratch_floats
        self.token_step_scratch_floats.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self.token_step_scratch_floats.restype = ctypes.c_int64

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., in] float32 @ weight [out, in] (float32 or bfloat16, contiguous).T -> [..., out]."""
        fn = self.bf16 if weight.dtype == torch.bfloat16 else self.f32
        out_features, in_features = weight.shape
        return _matmul(fn, weight, x, out_features, in_features, out_features)

    def column_linear(self, x: torch.Tensor, weight: ColumnBlocks) -> torch.Tensor:
        """x [..., in] float32 @ the blocked weight's [out, in].T -> [..., out] (column_blocks.c)."""
        fn = self.column_bf16 if weight.blocks.dtype == torch.bfloat16 else self.column_f32
        blocks, in_features = weight.blocks.shape[0], weight.blocks.shape[1]
        return _matmul(fn, weight.blocks, x, blocks * COLUMN_BLOCK, in_features, weight.out_features)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
        """q [B, heads, T, D] over k/v [kv_heads, B, L, D] (float32 or bfloat16), visible [B, 1, T, L]
        bool or None (every key) -> [B, heads, T, D] float32, each query row over the keys it sees in
        key order (fixed_order_attention.c)."""
        B, H, T, D = q.shape
        Hkv, L = k.shape[0], k.shape[2]
        if D % 8 or k.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype or H % Hkv:
            raise ValueError(f"fixed-order attention takes head_dim a multiple of 8 and float32 or bfloat16 K/V, "
                             f"got head_dim {D}, {k.dtype}/{v.dtype}, {H} heads over {Hkv}")
        if k.stride()[2:] != (D, 1) or v.stride() != k.stride():  # each (KV head, sequence)'s [L, D] read in place
            k, v = k.contiguous(), v.contiguous()
        q = q.float().contiguous()
        seen = None if visible is None else visible.expand(B, 1, T, L).contiguous().view(torch.uint8)  # [B, 1, T, L]
        out = torch.empty(B, H, T, D, dtype=torch.float32)
        if self._attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
                           None if seen is None else seen.data_ptr(), out.data_ptr(), B, H, Hkv, T, L, D, k.stride(0),
                           k.stride(1), scale, torch.get_num_threads()):
            raise MemoryError("fixed-order attention: no scratch for the scores")
        return out


def _matmul(fn, w: torch.Tensor, x: torch.Tensor, width: int, in_features: int, out_features: int) -> torch.Tensor:
    """x [..., in] through the kernel `fn` over the weight storage `w`, which computes `width`
    outputs a row; the first `out_features` of them -> [..., out_features]."""
    rows = _rows(x, in_features)  # [M, in]
    y = torch.empty(rows.shape[0], width, dtype=torch.float32, device="cpu")  # [M, width]
    fn(w.data_ptr(), rows.data_ptr(), y.data_ptr(), width, in_features, rows.shape[0], torch.get_num_threads())
    if width != out_features:
        y = y[:, :out_features].contiguous()
    return y.view(*x.shape[:-1], out_features)


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., in] as contiguous float32 rows [M, in] (a view when it already is: this runs for
    every matmul of a one-sequence pass, where each torch call's fixed cost counts)."""
    rows = x.reshape(-1, in_features)
    return rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()


def bf16_if_exact(w: torch.Tensor) -> torch.Tensor:
    """A bfloat16 copy of w if all its values are bf16 values (half the bytes, the same products),
    else w itself, contiguous."""
    half = w.to(torch.bfloat16)
    return half.contiguous() if w.dtype == torch.bfloat16 or torch.equal(half.float(), w) else w.contiguous()


def supports(weight: torch.Tensor) -> bool:
    """Whether `linear` takes this weight: CPU, 2-D, contiguous, float32 or bf16, width a multiple of 8."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[1] % 8 == 0)


def cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specserve")
    return Path(root) / "kernels"


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ("model name", "flags", ...; empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


@functools.cache
def build_digest() -> str:
    """What the library is built from (sources and flags): it names the build, and forward plans
    measured with another build are not reused."""
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    return hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]


def _build(compiler: str) -> Path:
    """Compiles the sources into one library named by their hash, written under a temporary name
    and renamed, so concurrent builders never load a half-written file."""
    target = cache_dir() / f"one_sequence-{build_digest()}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       errors="replace", timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load_built(compiler: str) -> OneSequenceKernels:
    """Loads the built library; a cached file that does not load (truncated, from another
    build) is removed and built once more."""
    path = _build(compiler)
    try:
        return OneSequenceKernels(ctypes.CDLL(str(path)))
    except (OSError, AttributeError):
        path.unlink(missing_ok=True)
        return OneSequenceKernels(ctypes.CDLL(str(_build(compiler))))


@functools.cache
def load() -> OneSequenceKernels | None:
    """The kernels, or None (logged once) where they cannot be built here."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        reason = f"CPU architecture {platform.machine()} (the kernels are x86-64 AVX2)"
    elif not {"avx2", "fma"} <= set(cpuinfo().get("flags", "").split()):
        reason = "this CPU lacks AVX2/FMA"
    elif (compiler := os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")) is None:
        reason = "no C compiler (cc/gcc) on PATH"
    else:
        try:
            return _load_built(compiler)
        except Exception as e:  # any failure here means "use oneDNN", never a failed model load
            detail = getattr(e, "stderr", "") or f"{type(e).__name__}: {e}"
            reason = f"building or loading {', '.join(p.name for p in SOURCES)} failed: {detail.strip()[:500]}"
    log.warning("one-sequence CPU kernels unavailable (%s); using oneDNN's for every pass", reason)
    return None
