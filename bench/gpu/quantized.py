"""Quantized weights against bf16 (section `quantized`, and `python -m bench quantized` on CPU):
the same random model stored bf16, FP8 (Qwen's 128x128 blocks) and INT4 (compressed-tensors W4A16,
groups of 128), and on CPU INT8 (W8A16, per channel), each loaded as the engine loads such a
checkpoint (QuantLinear: never dequantized into a dense copy), timed on plain batch-1 decoding,
interleaved. Reported: the step, bf16 ÷ each, and the weights' bytes. Goals on the GPU (Llama-3.1-8B
shape): FP8 >= 1.6x and INT4 >= 2.2x faster than bf16.

Checked first, right after each format loads: the loaded layers' outputs (layer 0's qkv, o, gate_up
and down, called as the forward calls them, at 1 and 16 rows: a decode and a verify pass, which on
CUDA take the Triton kernels) against x W^T with W dequantized, worst error relative to the output's
largest magnitude within 2e-2 (bf16). W is `layer.dequantize()` where the layer still holds its
stored form (CUDA), else dequantized from the checkpoint's stored tensors by the published layout
(on CPU torch's int4 / int8 kernels replace the stored form at load). Recorded with each format:
whether its CUDA graphs were kept and its fused path taken (on CUDA both are checks: a quantized
kernel that fails in the load-time probes turns them off), and the engine's kernel paths.

The quantized values are random draws in each layout (not a real model quantized): speed and
bytes depend on the layout, not on the values.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F

from bench.gpu.context import Context, check, goal
from bench.gpu.decode import median_of, random_prompts, timed_generate
from bench.random_checkpoints import LLAMA_3_1_8B, SMOKE_8B, RandomTensors, checkpoint_dir, weights_in_memory
from engine import LLM, SamplingParams

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_CT_WEIGHTS = {"actorder": None, "block_structure": None, "dynamic": False, "observer": "minmax",
               "observer_kwargs": {}, "symmetric": True, "type": "int"}
CONFIGS = {  # quantization_config as the published checkpoints write it
    "fp8": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
    "int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
             "quantization_status": "compressed", "config_groups": {"group_0": {
                 "targets": ["Linear"], "input_activations": None, "output_activations": None,
                 "weights": {**_CT_WEIGHTS, "num_bits": 4, "strategy": "group", "group_size": 128}}}},
    "int8": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
             "quantization_status": "compressed", "config_groups": {"group_0": {
                 "targets": ["Linear"], "input_activations": None, "output_activations": None,
                 "weights": {**_CT_WEIGHTS, "num_bits": 8, "strategy": "channel", "group_size": None}}}},
}
GOALS = {"fp8": 1.6, "int4": 2.2}  # bf16 step ÷ the format's, plain batch 1, on the GPU
TOLERANCE = 2e-2  # the kernels against the dequantized weights, bf16, relative to the output's scale
CHECKED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
           "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}  # layer 0's, as the engine fuses them


class QuantizedTensors(Mapping):
    """A checkpoint's tensors with its layers' linears in `layout` (random stored values of the
    right dtypes and shapes), the rest as RandomTensors makes them."""

    def __init__(self, config: dict, layout: str, dtype: torch.dtype, device: str):
        self.dense = RandomTensors(config, dtype, device)
        self.layout, self.device = layout, device
        self.parts: dict[str, tuple[str, tuple[int, int]]] = {}  # stored name -> (its part, the weight's shape)
        for name, shape in self.dense.shapes.items():
            if name.startswith("model.layers.") and name.endswith(tuple(f"{n}.weight" for n in LINEARS)):
                base = name.removesuffix("weight")
                for part in _parts(layout):
                    self.parts[base + part] = (part, shape)
            else:
                self.parts[name] = ("", shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        part, shape = self.parts[name]
        if not part:
            return self.dense[name]
        N, K = shape
        g = torch.Generator(device=self.device).manual_seed(zlib.crc32(name.encode()))
        return _stored(self.layout, part, N, K, g, self.device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)


def _parts(layout: str) -> tuple[str, ...]:
    return {"fp8": ("weight", "weight_scale_inv")}.get(layout, ("weight_packed", "weight_scale", "weight_shape"))


def _stored(layout: str, part: str, N: int, K: int, g: torch.Generator, device: str) -> torch.Tensor:
    """One stored tensor of a linear [N, K] in `layout`, dequantizing to about N(0, 0.02)."""
    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device)
    if part == "weight":  # e4m3
        return rand(N, K).clamp(-8, 8).to(torch.float8_e4m3fn)
    if part == "weight_scale_inv":
        return torch.full((-(-N // 128), -(-K // 128)), 0.02, device=device)
    if part == "weight_shape":
        return torch.tensor([N, K], device=device)
    bits = 4 if layout == "int4" else 8
    if part == "weight_scale":
        columns = K // 128 if bits == 4 else 1
        return torch.full((N, columns), 0.02 / (2 ** (bits - 1) / 2), dtype=torch.bfloat16, device=device)
    per_word = 32 // bits  # weight_packed: random words
    return torch.randint(-2**31, 2**31 - 1, (N, K // per_word), generator=g, device=device, dtype=torch.int64).int()


def stored_weight(tensors: Mapping, layout: str, module: str) -> torch.Tensor:
    """The float32 weight [N, K] of `module` dequantized from its stored tensors by the published
    layout (fp8: e4m3 x the 128x128 block's scale_inv; pack-quantized: (q - 2^(bits-1)) x the group's scale)."""
    if layout == "fp8":
        data, scale = tensors[module + ".weight"].float(), tensors[module + ".weight_scale_inv"].float()
        N, K = data.shape
        return data * scale.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    bits = 4 if layout == "int4" else 8
    N, K = tensors[module + ".weight_shape"].tolist()
    words = tensors[module + ".weight_packed"]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(N, -1)[:, :K].float()  # element i in bits i x bits
    scale = tensors[module + ".weight_scale"].float()
    return (q - 2 ** (bits - 1)) * scale.repeat_interleave(K // scale.shape[1], 1)


def dequantized(layer) -> torch.Tensor | None:
    """A QuantLinear's (or a LinearParts' parts') `dequantize()` in float32, None where the stored
    form is gone (replaced at load by a CPU kernel's)."""
    parts = getattr(layer, "parts", [layer])
    if any(isinstance(p, torch.Tensor) for p in parts) and len(parts) == 1:
        return parts[0].float()
    if any(not isinstance(p, torch.Tensor) and getattr(p, "data", None) is None for p in parts):
        return None
    return torch.cat([p.float() if isinstance(p, torch.Tensor) else p.dequantize(torch.float32) for p in parts])


def kernels_against_dequantized(ctx: Context, model, tensors: Mapping, layout: str) -> dict:
    """Layer 0's linears called as the forward calls them against x W^T in float32, at 1 and 16 rows."""
    g = torch.Generator(device="cpu").manual_seed(7)
    rows_out = {}
    for attr, modules in CHECKED.items():
        layer = getattr(model.layers[0], attr)
        weight = dequantized(layer)
        stored = weight is not None
        if weight is None:
            weight = torch.cat([stored_weight(tensors, layout, f"model.layers.0.{m}") for m in modules])
        worst = {}
        for rows in (1, 16):
            x = torch.randn(rows, weight.shape[1], generator=g).to(torch.bfloat16).to(ctx.device)
            with torch.inference_mode():
                got, want = layer(x).float(), F.linear(x.float(), weight)
            worst[rows] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        rows_out[attr] = {"form": getattr(layer, "form", type(layer).__name__), "shape": list(weight.shape),
                          "reference": "dequantize()" if stored else "the checkpoint's tensors", "by_rows": worst}
    return {"layers": rows_out, "worst": max(w for r in rows_out.values() for w in r["by_rows"].values())}


def engine_paths(llm) -> dict:
    """What the engine took at load: CUDA graphs per model (graphs, or why eager), the fused path, and
    every stats() entry naming kernels."""
    engine = llm.engine
    stats = engine.stats()
    graphs = {role: {"graphs": r.graphs, "fallback": r.fallback} for role, r in (engine.cuda_graphs or {}).items()}
    return {"cuda_graphs": graphs, "fused_kernels": dict(stats.get("fused_kernels", {})),
            **{k: v for k, v in stats.items() if "kernel" in k and k != "fused_kernels"}}


def linear_bytes(model) -> int:
    """Bytes of the layers' linears (scales and zero points included): what quantization shrinks."""
    linears = [w for lw in model.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    return sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes for w in linears)


def compare(ctx: Context, config: dict, layouts: tuple[str, ...], new_tokens: int, repeats: int, name: str) -> dict:
    """Plain batch-1 decoding of `config` stored bf16 and in each layout, interleaved `repeats` times."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = random_prompts(1, 32, config["vocab_size"], seed=5)
    engines, rows = {}, {}
    for layout in ("bf16", *layouts):
        cfg = config if layout == "bf16" else {**config, "quantization_config": CONFIGS[layout]}
        path = checkpoint_dir(ctx.work / f"{name}_{layout}", cfg)
        tensors = RandomTensors(config, torch.bfloat16, ctx.device) if layout == "bf16" else QuantizedTensors(
            config, layout, torch.bfloat16, ctx.device)
        with weights_in_memory({str(path): tensors}):
            engines[layout] = LLM(**ctx.engine_kwargs(1, 256, model=str(path), dtype="bfloat16"))
        stats = engines[layout].engine.stats()["weights"]["target"]
        rows[layout] = {"weight_bytes": stats["bytes"], "linear_bytes": linear_bytes(engines[layout].engine.model),
                        "format": stats["format"], "paths": engine_paths(engines[layout]), "runs": []}
        ctx.log(f"{name} {layout}: {stats['bytes'] / 2**30:.2f} GiB ({stats['format']}), {rows[layout]['paths']}")
        if layout != "bf16":  # before any timing: a run cut short by its budget still has it
            try:
                rows[layout]["against_dequantized"] = kernels_against_dequantized(ctx, engines[layout].engine.model,
                                                                                  tensors, layout)
            except Exception as exc:  # a kernel that does not run, recorded under its format
                rows[layout]["against_dequantized"] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
            ctx.log(f"{name} {layout} against the dequantized weights: {rows[layout]['against_dequantized']}")
        ctx.free()
    for _ in range(repeats):  # interleaved: each repeat runs every format once
        for layout, llm in engines.items():
            rows[layout]["runs"].append(timed_generate(ctx, llm, prompts, params))
    for row in rows.values():
        row["step_ms"] = median_of(row["runs"][1:] or row["runs"], "step_ms")
        row.pop("runs")
    for layout in layouts:
        rows[layout]["bf16_step_over_this"] = rows["bf16"]["step_ms"]["median"] / rows[layout]["step_ms"]["median"]
        rows[layout]["bytes_over_bf16"] = rows[layout]["weight_bytes"] / rows["bf16"]["weight_bytes"]
        rows[layout]["linear_bytes_over_bf16"] = rows[layout]["linear_bytes"] / rows["bf16"]["linear_bytes"]
    return rows


def run(ctx: Context, out: dict) -> None:
    config = ctx.size(LLAMA_3_1_8B, SMOKE_8B)
    out["shape"] = "Llama-3.1-8B" if not ctx.smoke else "smoke"
    layouts = ("fp8", "int4") if ctx.device.startswith("cuda") else ("int8", "int4")  # CPU: no fp8 kernel
    out["formats"] = compare(ctx, config, layouts, ctx.size(64, 8), ctx.size(5, 2), "quantized")
    cuda = ctx.device.startswith("cuda")
    for layout in layouts:
        row = out["formats"][layout]
        against = row["against_dequantized"]
        check(out, f"{layout}: layer 0's linears (kernels at 1 and 16 rows) = the dequantized weights within {TOLERANCE:g}",
              "error" not in against and against["worst"] <= TOLERANCE, against.get("error", against.get("worst")))
        paths = row["paths"]
        if cuda:  # on CPU graphs and the fused path are off unless asked for
            kept = paths["cuda_graphs"].get("target", {})
            check(out, f"{layout}: CUDA graphs kept", kept.get("graphs", 0) > 0 and kept.get("fallback") is None, kept)
            check(out, f"{layout}: the fused path taken", paths["fused_kernels"].get("target") == "fused",
                  paths["fused_kernels"])
        most = 0.28 if layout == "int4" else 0.52
        check(out, f"{layout}: the layers' linears take <= {most} of bf16's bytes", row["linear_bytes_over_bf16"] <= most,
              round(row["linear_bytes_over_bf16"], 3))
        if layout in GOALS:
            goal(out, f"{layout} plain batch-1 step >= {GOALS[layout]}x faster than bf16",
                 row["bf16_step_over_this"] >= GOALS[layout], round(row["bf16_step_over_this"], 3))
    out["summary"] = [f"{layout}: step {r['step_ms']['median']:.2f} ms" + (
        f", bf16 ÷ this {r['bf16_step_over_this']:.2f}x, linears {r['linear_bytes_over_bf16']:.3f} of bf16's bytes "
        f"(whole model {r['bytes_over_bf16']:.3f})" if layout != "bf16"
        else "") + _paths_line(r) for layout, r in out["formats"].items()]


def _paths_line(row: dict) -> str:
    graphs = row["paths"]["cuda_graphs"].get("target")
    against = row.get("against_dequantized", {})
    return ("; graphs " + ("off" if graphs is None else f"{graphs['graphs']}" if graphs["fallback"] is None
                           else f"eager ({graphs['fallback']})")
            + f"; fused {row['paths']['fused_kernels'].get('target', 'off')}"
            + (f"; vs dequantized: {against['error'] if 'error' in against else format(against['worst'], '.2e')}"
               if against else ""))
