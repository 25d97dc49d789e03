"""Each published layout's tensors for one linear layer, read into a QuantLinear (linear.py's two
forms), with the names and packings as the checkpoints store them:

- fp8_block (Qwen/Qwen3-*-FP8): `weight` e4m3 [N, K], `weight_scale_inv` [N / bn, K / bk], the
  multiplier that dequantizes;
- ct_float (compressed-tensors float-quantized, RedHatAI/*-FP8-dynamic): `weight` e4m3 [N, K],
  `weight_scale` [N, 1] (channel), [1] (tensor) or [N / bn, K / bk] (block);
- ct_pack (compressed-tensors pack-quantized, RedHatAI/*-quantized.w4a16): `weight_packed` int32
  [N, K x bits / 32], element i in bits i x bits, stored as q + 2^(bits-1); `weight_scale` [N,
  groups]; `weight_shape` [2]; with zero points, `weight_zero_point` packed the same way along the
  rows; weight = (q - zero) x scale;
- gptq (AutoGPTQ / gptqmodel): `qweight` int32 [K / 8, N] (element k in bits 4 (k % 8) of row k / 8),
  `qzeros` int32 [groups, N / 8] (along the columns), `scales` [groups, N], `g_idx` [K] (input k's
  group); v1 checkpoints store each zero point less one;
- awq (AutoAWQ, GEMM): `qweight` int32 [K, N / 8], `qzeros` [groups, N / 8], `scales` [groups,
  N]; a word's eight nibbles hold columns 8j + (0, 2, 4, 6, 1, 3, 5, 7).
"""

from __future__ import annotations

import torch

from engine.model.quant.linear import QuantLinear, int4_words, word_values
from engine.model.quant.schemes import Scheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column 8j + AWQ_ORDER[i] in nibble i of word j


def quantized_names(scheme: Scheme) -> tuple[str, ...]:
    """The tensor (after `module.`) that marks a linear as stored in the scheme's layout."""
    return {"fp8_block": ("weight_scale_inv",), "ct_float": ("weight_scale",), "ct_pack": ("weight_packed",),
            "gptq": ("qweight",), "awq": ("qweight",)}[scheme.layout]


def read_quantized(reader, scheme: Scheme, prefix: str) -> QuantLinear:
    """The linear whose tensors are `prefix` + name (reader.raw(name): the stored tensor, on the
    device; `name in reader`)."""
    return {"fp8_block": _fp8_block, "ct_float": _ct_float, "ct_pack": _ct_pack, "gptq": _gptq,
            "awq": _awq}[scheme.layout](reader, scheme, prefix)


def _fp8(weight: torch.Tensor, name: str) -> torch.Tensor:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} is stored as {weight.dtype}: the scheme's layout stores it as float8 e4m3")
    return weight


def _fp8_block(reader, scheme: Scheme, prefix: str) -> QuantLinear:
    weight = _fp8(reader.raw(prefix + "weight"), prefix + "weight")
    return QuantLinear("fp8", weight, reader.raw(prefix + "weight_scale_inv"), tuple(weight.shape), block=scheme.block)


def _ct_float(reader, scheme: Scheme, prefix: str) -> QuantLinear:
    weight = _fp8(reader.raw(prefix + "weight"), prefix + "weight")
    scale = reader.raw(prefix + "weight_scale")
    N, K = weight.shape
    if scheme.block:
        block = scheme.block
    elif scale.numel() == 1:
        scale, block = scale.reshape(1, 1), (N, K)  # one scale for the tensor
    else:
        scale, block = scale.reshape(N, 1), (1, K)  # one a row
    return QuantLinear("fp8", weight, scale, (N, K), block=block)


def _ct_pack(reader, scheme: Scheme, prefix: str) -> QuantLinear:
    N, K = (int(v) for v in reader.raw(prefix + "weight_shape").tolist())
    q = word_values(reader.raw(prefix + "weight_packed"), scheme.bits, K)  # [N, K], stored as q + 2^(bits - 1)
    scale = reader.raw(prefix + "weight_scale").reshape(N, -1)  # [N, groups]
    if scheme.symmetric:
        zero = torch.full(scale.shape, 1 << (scheme.bits - 1), dtype=torch.uint8, device=scale.device)
    else:  # packed along the rows
        zero = word_values(reader.raw(prefix + "weight_zero_point").T.contiguous(), scheme.bits, N).T.to(torch.uint8)
    data = int4_words(q) if scheme.bits == 4 else q.to(torch.uint8)
    return QuantLinear("int", data, scale, (N, K), bits=scheme.bits, zero=zero, group=scheme.group_size or K)


def _grouped(reader, scheme: Scheme, prefix: str, q_kn: torch.Tensor, zeros_gn: torch.Tensor) -> QuantLinear:
    """q_kn [K, N], zeros [groups, N]: the canonical form, inputs reordered by g_idx where it is not
    the input order (act-order: the groups are then contiguous)."""
    K, N = q_kn.shape
    group = scheme.group_size or K
    scale = reader.raw(prefix + "scales").T.contiguous()  # [N, groups]
    zero = zeros_gn.T.contiguous().to(torch.uint8)  # [N, groups]
    perm = None
    if scheme.act_order and prefix + "g_idx" not in reader:
        raise ValueError(f"quantization_config.desc_act is true but {prefix}g_idx is missing: the groups' input "
                         "order is unknown")
    if prefix + "g_idx" in reader:
        g_idx = reader.raw(prefix + "g_idx").long()
        if not torch.equal(g_idx, torch.arange(K, device=g_idx.device) // group):
            perm = torch.argsort(g_idx, stable=True)
            q_kn = q_kn.index_select(0, perm)
    return QuantLinear("int", int4_words(q_kn.T.contiguous()), scale, (N, K), bits=4, zero=zero, group=group, perm=perm)


def _gptq(reader, scheme: Scheme, prefix: str) -> QuantLinear:
    qweight = reader.raw(prefix + "qweight")  # [K / 8, N]
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    q = word_values(qweight.T.contiguous(), 4, K).T  # [K, N]: along the inputs, as the words run
    zeros = word_values(reader.raw(prefix + "qzeros"), 4, N)  # [groups, N]: along the columns
    if scheme.zeros_minus_one:
        zeros = zeros + 1
    return _grouped(reader, scheme, prefix, q, zeros)


def _awq_unpack(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """[R, N / 8] words in AWQ's order -> [R, N]."""
    nibbles = word_values(packed, 4, packed.shape[-1] * 8).view(*packed.shape, 8)  # [R, W, 8] nibble i
    order = torch.tensor(AWQ_ORDER, device=packed.device)
    out = torch.empty_like(nibbles)
    out[..., order] = nibbles  # column 8j + AWQ_ORDER[i] <- nibble i
    return out.reshape(packed.shape[0], -1)[:, :columns]


def _awq(reader, scheme: Scheme, prefix: str) -> QuantLinear:
    qweight = reader.raw(prefix + "qweight")  # [K, N / 8]
    N = reader.raw(prefix + "scales").shape[1]
    return _grouped(reader, scheme, prefix, _awq_unpack(qweight, N), _awq_unpack(reader.raw(prefix + "qzeros"), N))
