"""Tiny checkpoints in each published quantized layout, made from a dense one, each beside a dense
reference holding the weights its quantized tensors stand for. The packing is never ours:
compressed-tensors' own compressors pack its formats (and Qwen's FP8 blocks, renamed as Qwen
stores them), and GPTQ and AWQ are packed here by their documented layouts, independent of the
engine's reader (the layout tests pin single words of each).

Each LAYOUTS entry names the published checkpoint whose config.json its quantization_config copies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i of a word holds column 8j + AWQ_ORDER[i]
# a Qwen3 shape whose linears split into whole 128-wide groups and blocks, as the published ones do
SHAPE = dict(model_type="qwen3", hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, layers=2)


def _ct_group(weights: dict, fmt: str, acts: dict | None = None) -> dict:
    base = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
            "observer": "minmax", "observer_kwargs": {}, "symmetric": True}
    return {"config_groups": {"group_0": {"input_activations": acts, "output_activations": None,
                                          "targets": ["Linear"], "weights": {**base, **weights}}},
            "format": fmt, "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed"}


TOKEN_ACTS = {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None, "num_bits": 8,
              "observer": None, "observer_kwargs": {}, "strategy": "token", "symmetric": True, "type": "float"}
CONFIGS = {
    # Qwen/Qwen3-8B-FP8
    "qwen_fp8": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
    # RedHatAI/Qwen3-8B-FP8-dynamic
    "ct_fp8_dynamic": _ct_group({"num_bits": 8, "type": "float", "strategy": "channel"}, "float-quantized", TOKEN_ACTS),
    # RedHatAI/Qwen3-8B-quantized.w4a16
    "ct_w4a16": _ct_group({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, "pack-quantized"),
    # the same with zero points (llm-compressor's W4A16_ASYM preset)
    "ct_w4a16_asym": _ct_group({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                "symmetric": False}, "pack-quantized"),
    # RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a16
    "ct_w8a16": _ct_group({"num_bits": 8, "type": "int", "strategy": "channel"}, "pack-quantized"),
    # Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4
    "gptq": {"batch_size": 1, "bits": 4, "block_name_to_quantize": None, "cache_block_outputs": True,
             "damp_percent": 0.01, "dataset": None, "desc_act": False, "exllama_config": {"version": 1},
             "group_size": 128, "max_input_length": None, "model_seqlen": None,
             "module_name_preceding_first_block": None, "modules_in_block_to_quantize": None, "pad_token_id": None,
             "quant_method": "gptq", "sym": True, "tokenizer": None, "true_sequential": True,
             "use_cuda_fp16": False, "use_exllama": True},
    # act-order and zero points, as gptqmodel writes them (e.g. ModelCloud's desc_act checkpoints)
    "gptq_act_order_asym": {"bits": 4, "checkpoint_format": "gptq", "damp_percent": 0.01, "desc_act": True,
                            "group_size": 128, "quant_method": "gptq", "static_groups": False, "sym": False,
                            "true_sequential": True},
    # Qwen/Qwen2.5-7B-Instruct-AWQ
    "awq": {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq",
            "version": "gemm", "zero_point": True},
}
LAYOUTS = tuple(CONFIGS)


def is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(tuple(f"{n}.weight" for n in LINEARS))


def write(src: Path, dst: Path, layout: str, group_size: int | None = None) -> tuple[Path, Path]:
    """(quantized checkpoint, dense float32 reference) made from the dense checkpoint `src`
    (group_size: the published config's, changed, for models narrower than its groups)."""
    quantize = _ct if layout in _CT_LAYOUTS else _awq if layout == "awq" else _gptq
    config = _with_group_size(CONFIGS[layout], group_size) if group_size else CONFIGS[layout]
    quant, ref = dst / layout, dst / f"{layout}_reference"
    for d in (quant, ref):
        shutil.copytree(src, d)
    packed, dense = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if is_linear(name):
            stored, weight = quantize(config, t.float())
            packed.update({name.removesuffix("weight") + k: v for k, v in stored.items()})
            dense[name] = weight.float()
        else:
            packed[name] = dense[name] = t
    save_file(packed, quant / "model.safetensors", metadata={"format": "pt"})
    save_file(dense, ref / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (quant / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}, indent=2))
    return quant, ref


def _with_group_size(config: dict, group_size: int) -> dict:
    config = json.loads(json.dumps(config))
    if config["quant_method"] == "compressed-tensors":
        config["config_groups"]["group_0"]["weights"]["group_size"] = group_size
    else:
        config["group_size"] = group_size
    return config


# --- compressed-tensors' compressors ------------------------------------------------------------
_CT_LAYOUTS = ("qwen_fp8", "ct_fp8_dynamic", "ct_w4a16", "ct_w4a16_asym", "ct_w8a16")


def _ct_scheme(config: dict):
    """The scheme compressed-tensors quantizes with: its FP8_BLOCK preset for Qwen's blocks, the
    published config's weight arguments for its own formats."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    if config["quant_method"] == "fp8":
        return preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    weights = config["config_groups"]["group_0"]["weights"]
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))


def _ct(config: dict, weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' quantization of one weight [N, K]: (stored tensors, their dequantized weight)."""
    from compressed_tensors.compressors import FloatQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _ct_scheme(config)
    args = scheme.weights
    N, K = weight.shape
    if args.strategy == "block":
        bn, bk = args.block_structure
        view, dims = weight.view(N // bn, bn, K // bk, bk), (1, 3)
    elif args.strategy == "group":
        view, dims = weight.view(N, K // args.group_size, args.group_size), (2,)
    else:  # channel
        view, dims = weight, (1,)
    low, high = view.amin(dim=dims), view.amax(dim=dims)
    if args.strategy == "channel":
        low, high = low[:, None], high[:, None]
    scale, zero = calculate_qparams(low, high, args)
    compressor = FloatQuantizationCompressor if args.type == "float" else PackedQuantizationCompressor
    stored = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme)
    dense = compressor.decompress(dict(stored), scheme)["weight"]
    stored = {k: v for k, v in stored.items() if v is not None}
    if config["quant_method"] == "fp8":  # Qwen stores the block scales as `weight_scale_inv`, the multiplier
        stored["weight_scale_inv"] = stored.pop("weight_scale")
    return stored, dense


# --- GPTQ and AWQ, by their documented layouts ----------------------------------------------------
def _int4_groups(weight: torch.Tensor, group_of: torch.Tensor, groups: int, symmetric: bool, min_zero: int = 0):
    """Round-to-nearest 4-bit weights: q [N, K] in 0..15, scale and zero [N, groups] (zero >= min_zero)."""
    N, K = weight.shape
    onehot = torch.nn.functional.one_hot(group_of, groups).bool()  # [K, G]
    masked = weight[:, :, None].expand(N, K, groups)
    high = torch.where(onehot, masked, -torch.inf).amax(1).clamp(min=0)  # [N, G]
    low = torch.where(onehot, masked, torch.inf).amin(1).clamp(max=0)
    if symmetric:
        scale, zero = torch.maximum(high, -low) / 7.5, torch.full_like(high, 8.0)
    else:
        scale = (high - low) / 15
        zero = torch.round(-low / scale.clamp(min=1e-8)).clamp(min_zero, 15)
    scale = scale.clamp(min=1e-8).half().float()  # the checkpoints store fp16 scales
    q = torch.clamp(torch.round(weight / scale[:, group_of]) + zero[:, group_of], 0, 15)
    return q.int(), scale, zero.int()


def to_words(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, 8W] in 0..15 -> [R, W] int32, nibble i of word j holding column 8j + order[i]."""
    R, C = values.shape
    chunks = values.view(R, C // 8, 8)[..., list(order)].long()
    words = (chunks << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).int()


def _gptq(cfg: dict, weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """AutoGPTQ's v1 layout: qweight [K / 8, N] packed down the inputs, qzeros [G, N / 8] packed
    along the outputs holding each zero less one, fp16 scales [G, N], g_idx [K]."""
    N, K = weight.shape
    group, G = cfg["group_size"], K // cfg["group_size"]
    order = torch.randperm(K, generator=torch.Generator().manual_seed(K)) if cfg["desc_act"] else torch.arange(K)
    g_idx = torch.empty(K, dtype=torch.long)
    g_idx[order] = torch.arange(K) // group  # act-order: groups follow the activation order
    q, scale, zero = _int4_groups(weight, g_idx, G, cfg["sym"], min_zero=1)  # v1 cannot store a zero point of 0
    stored = {"qweight": to_words(q).T.contiguous(),
              "qzeros": to_words((zero - 1).T.contiguous()), "scales": scale.T.contiguous().half(),
              "g_idx": g_idx.int()}
    return stored, (q - zero[:, g_idx]) * scale[:, g_idx]


def _awq(config: dict, weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [K, N / 8] and qzeros [G, N / 8] in its nibble order, fp16 scales [G, N]."""
    N, K = weight.shape
    group = config["group_size"]
    g = torch.arange(K) // group
    q, scale, zero = _int4_groups(weight, g, K // group, symmetric=False)
    stored = {"qweight": to_words(q.T.contiguous(), AWQ_ORDER), "qzeros": to_words(zero.T.contiguous(), AWQ_ORDER),
              "scales": scale.T.contiguous().half()}
    return stored, (q - zero[:, g]) * scale[:, g]
