"""`QuantLinear`: a linear layer whose weight [out, in] stays quantized on the device, called as
`layer(x)`; the forward does not know its format. Two forms, whatever the checkpoint's layout:

- fp8: e4m3 values `data` [N, K] and `scale` [ceil(N / bn), ceil(K / bk)], one a block of (bn, bk)
  elements (a row per channel: (1, K); the whole tensor: (N, K)); weight = data x scale;
- int: unsigned integers of `bits` bits, 4-bit eight a word along the input (`data` int32
  [N, K / 8], element k in bits 4 (k % 8)), 8-bit as uint8 [N, K]; `scale` and the uint8 `zero`
  (an integer zero point, 2^(bits-1) where symmetric) [N, groups] of `group` inputs each; weight
  = (data - zero) x scale.
Scales stay in the checkpoint's precision; the arithmetic is float32. `perm` (GPTQ's act-order): the inputs are stored in this order, so x is
  gathered by it first.

How it runs is chosen once (`prepare`, its choice in `path`): on CPU, 4-bit groups of 32-256
through torch's int4 kernel and symmetric per-channel 8-bit through its int8 kernel, the rest
dequantized one layer at a time, each call; with the Triton kernels (CUDA; the interpreter in
tests), fp8 and 4-bit weights read as stored (kernels/quant.py: e4m3 converted by the hardware
from sm_89, from its bits below), for every pass of up to KERNEL_ROWS rows, so a decode pass and
a verify pass compute each row alike; wider passes (long prefill chunks) dequantize a layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.kernels import quant

CPU_INT4_GROUPS = (32, 64, 128, 256)
KERNEL_ROWS = 1024  # passes up to this many rows (decode, verify at batch 64 x K 15) take the Triton kernel
NATIVE_FP8 = (8, 9)  # the compute capability from which the hardware converts e4m3


class QuantLinear:
    def __init__(self, kind: str, data: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], *,
                 block: tuple[int, int] | None = None, bits: int = 8, zero: torch.Tensor | None = None,
                 group: int | None = None, perm: torch.Tensor | None = None):
        if kind not in ("fp8", "int"):
            raise ValueError(f"QuantLinear kind must be fp8 or int, got {kind!r}")
        self.kind, self.data, self.scale, self.shape = kind, data, scale, tuple(shape)
        self.block, self.bits, self.zero, self.group, self.perm = block, bits, zero, group, perm
        self._run = None  # the prepared call: x -> y
        self.path = "unprepared"  # how calls run: "triton fp8", "cpu int4", "dequantized", ...
        self._prepared: tuple[torch.Tensor, ...] = ()  # a kernel's form of the weight, where it replaces the stored one

    # --- the stored form ------------------------------------------------------------------------
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def form(self) -> str:
        """What it is stored as, e.g. "fp8 block 128x128", "int4 group 128", "int8 channel"."""
        if self.kind == "fp8":
            bn, bk = self.block
            return "fp8 " + ("tensor" if (bn, bk) == self.shape else "channel" if (bn, bk) == (1, self.shape[1])
                             else f"block {bn}x{bk}")
        return f"int{self.bits} " + ("channel" if self.group == self.shape[1] else f"group {self.group}")

    @property
    def nbytes(self) -> int:
        """Bytes the weight takes on its device, scales and zero points included."""
        tensors = self._prepared or [t for t in (self.data, self.scale, self.zero, self.perm) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in `dtype` (inputs in stored order: `perm` applies to x)."""
        N, K = self.shape
        if self.kind == "fp8":
            bn, bk = self.block
            scale = self.scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]  # [N, K]
            return (self.data.float() * scale.float()).to(dtype)
        q = word_values(self.data, 4, K) if self.bits == 4 else self.data.int()  # [N, K]
        scale = self.scale.float().repeat_interleave(self.group, 1)[:, :K]
        zero = self.zero.float().repeat_interleave(self.group, 1)[:, :K]
        return ((q.float() - zero) * scale).to(dtype)

    # --- running -------------------------------------------------------------------------------
    def prepare(self, dtype: torch.dtype, triton: bool | None = None,
                capability: tuple[int, int] | None = None) -> QuantLinear:
        """Chooses how calls run, for activations in `dtype`: the Triton kernels where `triton`
        (None: on CUDA) and one reads this form at `capability` (None: the device's); else on CPU
        torch's int kernels where they read it; else dequantized a layer a call."""
        on_cpu = self.data is None or self.data.device.type == "cpu"  # None: a CPU kernel's form replaced it
        if (not on_cpu if triton is None else triton) and self.data is not None:
            if self._triton(capability or device_capability(self.data.device)) is not None:
                return self
        if on_cpu:
            cpu = self._cpu_int4(dtype) or self._cpu_int8(dtype)
            self._run, self.path = (cpu, f"cpu int{self.bits}") if cpu else (self._dequantized, "dequantized")
        else:
            self._run, self.path = self._dequantized, "dequantized"
        return self

    def _triton(self, capability: tuple[int, int]):
        """The Triton kernel for this form at `capability`, set as the call; None where none reads it."""
        if self.kind == "fp8":
            native = capability >= NATIVE_FP8
            self.path = "triton fp8" + ("" if native else " (e4m3 from its bits)")

            def kernel(flat):
                return quant.fp8_linear(flat, self, native)
        elif self.bits == 4:
            self.path = "triton int4"

            def kernel(flat):
                return quant.int4_linear(flat, self)
        else:
            return None

        def run(x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // x.shape[-1]
            if rows > KERNEL_ROWS:
                return self._dequantized(x)
            return kernel(x.reshape(rows, x.shape[-1])).view(*x.shape[:-1], self.shape[0])
        self._run = run
        return run

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x W^T [..., N]."""
        if self._run is None:
            self.prepare(x.dtype)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return self._run(x)

    def _dequantized(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))

    def _cpu_int4(self, dtype: torch.dtype):
        """torch's CPU int4 kernel: weight = (q - 8) x scale + (8 - zero) x scale, per group."""
        if self.kind != "int" or self.bits != 4 or self.group not in CPU_INT4_GROUPS or self.shape[1] % self.group:
            return None
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(word_values(self.data, 4, self.shape[1]), 1)
        scale = self.scale.float()
        scales_zeros = torch.stack([scale.T, ((8.0 - self.zero.float()) * scale).T], dim=-1).to(dtype)  # [G, N, 2]
        self._prepared = (packed, scales_zeros)
        self.data = self.zero = None  # the kernel's form replaces the stored one
        group = self.group

        def run(x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group, scales_zeros.to(x.dtype))
            return y.view(*x.shape[:-1], y.shape[-1])
        return run

    def _cpu_int8(self, dtype: torch.dtype):
        """torch's CPU int8 kernel: symmetric, one scale a row."""
        if self.kind != "int" or self.bits != 8 or self.group != self.shape[1] or not bool((self.zero == 128).all()):
            return None
        weight = (self.data.int() - 128).to(torch.int8)  # [N, K]
        scales = self.scale[:, 0].float().to(dtype)  # [N]
        self._prepared = (weight, scales)
        self.data = self.zero = None

        def run(x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])
            y = torch.ops.aten._weight_int8pack_mm(flat, weight, scales.to(x.dtype))
            return y.view(*x.shape[:-1], y.shape[-1])
        return run

class LinearParts:
    """Linears over the same input whose outputs are concatenated (the q/k/v or gate/up of a layer
    whose parts cannot be stored as one: different fp8 blocks, or act-order permutations)."""

    def __init__(self, parts: list):
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def form(self) -> str:
        return " + ".join(sorted({p.form if isinstance(p, QuantLinear) else str(p.dtype).removeprefix("torch.")
                                  for p in self.parts}))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes if isinstance(p, QuantLinear) else p.numel() * p.element_size() for p in self.parts)

    def prepare(self, dtype: torch.dtype, triton: bool | None = None,
                capability: tuple[int, int] | None = None) -> LinearParts:
        for p in self.parts:
            if isinstance(p, QuantLinear):
                p.prepare(dtype, triton, capability)
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) if isinstance(p, QuantLinear) else F.linear(x, p) for p in self.parts], dim=-1)


def fuse(parts: list):
    """One linear for parts over the same input, their outputs side by side: a dense weight, one
    QuantLinear where their forms line up, else LinearParts."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, QuantLinear) for p in parts) and _stackable(parts):
        first = parts[0]
        cat = (lambda ts: None if ts[0] is None else torch.cat(ts))  # noqa: E731
        return QuantLinear(first.kind, cat([p.data for p in parts]), cat([p.scale for p in parts]),
                           (sum(p.shape[0] for p in parts), first.shape[1]), block=first.block, bits=first.bits,
                           zero=cat([p.zero for p in parts]), group=first.group, perm=first.perm)
    return LinearParts(parts)


def _stackable(parts: list[QuantLinear]) -> bool:
    first = parts[0]
    if any((p.kind, p.bits, p.group, p.block, p.shape[1]) != (first.kind, first.bits, first.group, first.block,
                                                                 first.shape[1]) or p.perm is not None for p in parts):
        return False
    if first.kind == "fp8":  # blocks of rows must not straddle two parts
        bn = first.block[0]
        return bn == 1 or all(p.shape[0] % bn == 0 for p in parts[:-1])
    return True


def device_capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability ((9, 0) off CUDA: the interpreter reads every type)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)


def word_values(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[..., W] int32 words, 32 / bits values a word along the last dimension (element i in bits
    i x bits) -> [..., count] int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [32 / bits]
    values = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # [..., W, 32 / bits]
    return values.reshape(*packed.shape[:-1], -1)[..., :count]


def int4_words(values: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 -> [N, ceil(K / 8)] int32 (element k in bits 4 (k % 8))."""
    N, K = values.shape
    padded = F.pad(values.long(), (0, (-K) % 8)).view(N, -1, 8)  # [N, W, 8]
    words = (padded << torch.arange(0, 32, 4, device=values.device)).sum(-1)  # [N, W] in [0, 2^32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
