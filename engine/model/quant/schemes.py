"""The quantization a checkpoint's `quantization_config` names, read into a `Scheme`, or refused
with an error naming the key and its value: only what the engine computes is accepted.

Implemented (the published layouts, config keys as written):
- Qwen's FP8 (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`,
  `activation_scheme: dynamic`): e4m3 weights, one `weight_scale_inv` a block;
- compressed-tensors (`quant_method: compressed-tensors`): `format: float-quantized` (8-bit float
  weights, per channel, per tensor or per block; `*-FP8-dynamic`) and `format: pack-quantized`
  (4- or 8-bit integer weights packed into int32, per group or per channel, symmetric or with
  zero points; `*-quantized.w4a16`);
- GPTQ (`quant_method: gptq`, `bits: 4`, any `group_size`, `sym`, `desc_act` with `g_idx`;
  `checkpoint_format` gptq, whose zeros are stored minus one, or gptq_v2);
- AWQ (`quant_method: awq`, `bits: 4`, `version: gemm`, `zero_point`).
Activations are computed in the model's dtype (weight-only): a checkpoint's dynamic activation
quantization is a speed choice of other servers, not part of its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("fp8", "compressed-tensors", "gptq", "awq")


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint's quantized linears are stored."""

    layout: str  # "fp8_block", "ct_float", "ct_pack", "gptq", "awq"
    bits: int  # 8 (fp8, int8) or 4
    group_size: int | None = None  # integer schemes: inputs a scale covers (None: the whole row, per channel)
    block: tuple[int, int] | None = None  # fp8_block: (out, in) elements a scale covers
    symmetric: bool = True
    act_order: bool = False  # GPTQ desc_act: groups follow g_idx, which must then be stored
    zeros_minus_one: bool = False  # GPTQ's v1 format stores each zero point less one
    ignore: tuple[str, ...] = ()  # modules left unquantized (dense), by name or its last part

    def quantizes(self, module: str) -> bool:
        """Whether the linear named `module` (e.g. model.layers.0.self_attn.q_proj) is quantized."""
        return not any(module == n or module.endswith("." + n) or (n.startswith("re:") and _matches(n[3:], module))
                       for n in self.ignore)


def _matches(pattern: str, module: str) -> bool:
    import re

    return re.fullmatch(pattern, module) is not None


def refuse(key: str, value, why: str) -> ValueError:
    return ValueError(f"quantization_config.{key}={value!r} is not implemented: {why} (docs/models/quantized.md)")


def scheme_of(cfg: dict) -> Scheme | None:
    """The Scheme of a config.json (None: not quantized); ValueError naming the key otherwise."""
    q = cfg.get("quantization_config") or cfg.get("compression_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise refuse("", q, "a mapping is expected")
    method = q.get("quant_method")
    readers = {"fp8": _fp8, "compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq}
    if method not in readers:
        raise refuse("quant_method", method, f"implemented: {', '.join(METHODS)}")
    return readers[method](q)


def _fp8(q: dict) -> Scheme:
    if q.get("fmt", "e4m3") != "e4m3":
        raise refuse("fmt", q.get("fmt"), "e4m3 weights only")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise refuse("weight_block_size", block, "a block of [out, in] elements a scale is expected")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse("activation_scheme", q.get("activation_scheme"), "dynamic (weights only) is implemented")
    return Scheme("fp8_block", 8, block=(block[0], block[1]), ignore=tuple(q.get("modules_to_not_convert") or ()))


def _compressed_tensors(q: dict) -> Scheme:
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(key):
            raise refuse(key, q[key], "only weight quantization of Linear layers is implemented")
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse("config_groups", sorted(groups), "exactly one group of Linear layers is implemented")
    name, group = next(iter(groups.items()))
    fmt = group.get("format") or fmt  # a group may name its own format
    w = group.get("weights") or {}
    if group.get("targets") not in (["Linear"], None):
        raise refuse(f"config_groups.{name}.targets", group.get("targets"), "Linear only")
    if group.get("output_activations"):
        raise refuse(f"config_groups.{name}.output_activations", group.get("output_activations"), "not implemented")
    acts = group.get("input_activations")
    if acts and not acts.get("dynamic", False):
        raise refuse(f"config_groups.{name}.input_activations.dynamic", acts.get("dynamic"),
                     "static activation scales are not implemented (dynamic ones are: weights only)")
    strategy, bits, kind = w.get("strategy"), w.get("num_bits"), w.get("type")
    ignore = tuple(q.get("ignore") or ())
    at = f"config_groups.{name}.weights"
    if fmt == "float-quantized":
        if (kind, bits) != ("float", 8):
            raise refuse(f"{at}.num_bits", bits, "float-quantized: 8-bit float weights only")
        if strategy not in ("channel", "tensor", "block"):
            raise refuse(f"{at}.strategy", strategy, "channel, tensor or block")
        block = tuple(w.get("block_structure") or ()) if strategy == "block" else None
        return Scheme("ct_float", 8, block=block or None, ignore=ignore)
    if fmt == "pack-quantized":
        if kind != "int" or bits not in (4, 8):
            raise refuse(f"{at}.num_bits", bits, "pack-quantized: 4- or 8-bit integer weights")
        if strategy not in ("group", "channel"):
            raise refuse(f"{at}.strategy", strategy, "group or channel")
        if w.get("actorder") not in (None, "static", "weight"):
            raise refuse(f"{at}.actorder", w.get("actorder"), "group activation order needs g_idx, not implemented")
        group_size = w.get("group_size") if strategy == "group" else None
        return Scheme("ct_pack", bits, group_size=group_size, symmetric=bool(w.get("symmetric", True)), ignore=ignore)
    raise refuse("format", fmt, "float-quantized or pack-quantized")


def _gptq(q: dict) -> Scheme:
    if q.get("bits") != 4:
        raise refuse("bits", q.get("bits"), "4-bit GPTQ only")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse("checkpoint_format", fmt, "gptq or gptq_v2")
    group = q.get("group_size", 128)
    return Scheme("gptq", 4, group_size=None if group in (-1, None) else group, symmetric=bool(q.get("sym", True)),
                  act_order=bool(q.get("desc_act", False)), zeros_minus_one=fmt == "gptq",
                  ignore=tuple(q.get("modules_to_not_convert") or ()))


def _awq(q: dict) -> Scheme:
    if q.get("bits", q.get("w_bit")) != 4:
        raise refuse("bits", q.get("bits", q.get("w_bit")), "4-bit AWQ only")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse("version", q.get("version"), "the GEMM packing only")
    group = q.get("group_size", q.get("q_group_size", 128))
    return Scheme("awq", 4, group_size=group, symmetric=not q.get("zero_point", True),
                  ignore=tuple(q.get("modules_to_not_convert") or ()))
