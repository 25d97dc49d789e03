"""Find a checkpoint (local dir, the embedded pair, the local HF cache) and load its weights,
tensor by tensor from (sharded) safetensors, fused per layer: peak memory near one copy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from engine.config import ModelPlan
from engine.model.families import check_config, family_of, shape_of
from engine.model.quant.layouts import quantized_names, read_quantized
from engine.model.quant.linear import QuantLinear
from engine.model.quant.schemes import Scheme, scheme_of
from engine.model.shape import ModelShape
from engine.model.transformer import Transformer

EMBEDDED_PREFIX = "embedded:"


def models_dir() -> Path:
    """Where the embedded default pair lives (override with SPECSERVE_MODELS_DIR)."""
    env = os.environ.get("SPECSERVE_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


def resolve_model_path(name: str) -> Path:
    """A local directory, 'embedded:<name>' (the shipped pair), or an HF model id in the cache."""
    if name.startswith(EMBEDDED_PREFIX):
        path = models_dir() / name[len(EMBEDDED_PREFIX):]
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"the embedded default model {name!r} is not present at {path}; build it with "
                "`python tools/make_default_pair.py` or pass model=<local dir or HF id>")
        return path
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=name, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError) as exc:
        raise FileNotFoundError(
            f"model {name!r} is neither a local directory nor in the local Hugging Face cache "
            f"({HF_HUB_CACHE}); no network download is attempted") from exc


def _weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


# stored dtypes the forward reads; anything else (float8, integers) is a quantized weight it would misread
FLOAT_DTYPES = ("F32", "BF16", "F16")
UNUSED_TENSORS = ("rotary_emb.inv_freq",)  # buffers older checkpoints carry: recomputed from the config


class _TensorReader:
    """Reads named tensors from safetensors files, keeping each file open once, and remembers
    which it read, so that a tensor the forward never reads is refused (`check_all_read`)."""

    def __init__(self, files: dict[str, Path], dtype: torch.dtype, device: str, scheme: Scheme | None = None):
        """scheme: how the checkpoint's quantized linears are stored (None: none are)."""
        from safetensors import safe_open

        self.files = files
        self.dtype, self.device, self.scheme = dtype, device, scheme
        self._handles = {p: safe_open(str(p), framework="pt") for p in set(files.values())}
        self.read: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        """The tensor in the plan's dtype, on the device; a quantized one read as a plain weight is refused."""
        tensor = self.raw(name)
        if not tensor.is_floating_point() or tensor.element_size() < 2:
            raise ValueError(f"tensor {name} is stored as {tensor.dtype}: quantized, but the checkpoint's "
                             "quantization_config does not cover it (docs/models/quantized.md)")
        return tensor.to(dtype=self.dtype)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored, on the device."""
        if name not in self.files:
            raise KeyError(f"tensor {name!r} missing from the checkpoint")
        self.read.add(name)
        return self._handles[self.files[name]].get_tensor(name).to(device=self.device)

    def linear(self, module: str) -> torch.Tensor | QuantLinear:
        """`module`'s weight [out, in]: in the plan's dtype, or a QuantLinear where the scheme stores it quantized."""
        s = self.scheme
        if s is not None and s.quantizes(module) and all(f"{module}.{n}" in self for n in quantized_names(s)):
            return read_quantized(self, s, module + ".")
        return self.get(module + ".weight")

    def check_floats(self, where: Path) -> None:
        """ValueError naming a tensor stored in a dtype the forward would misread (a quantized weight)."""
        for name, file in self.files.items():
            if file not in self._handles:  # served from elsewhere (a subclass's tensors)
                continue
            stored = self._handles[file].get_slice(name).get_dtype()
            if stored not in FLOAT_DTYPES:
                raise ValueError(f"{where}: tensor {name} is stored as {stored}: quantized weights are not "
                                 f"implemented (the forward reads {', '.join(FLOAT_DTYPES)})")

    def check_all_read(self, where: Path) -> None:
        """ValueError naming the tensors the forward did not read: their math would be missing."""
        unread = sorted(n for n in set(self.files) - self.read if not n.endswith(UNUSED_TENSORS))
        if unread:
            raise ValueError(f"{where}: {len(unread)} checkpoint tensor(s) the forward does not read, e.g. "
                             f"{unread[:4]}: a layer or format it does not implement")


def read_config(path: Path) -> dict:
    """config.json, refusing a family, keys or a quantization the forward does not implement
    (families.py, config_keys.py, quant/schemes.py)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    check_config(cfg, str(path))
    return cfg


def read_shape(path: Path) -> ModelShape:
    """The model's shape from its config.json (no weights read)."""
    return shape_of(read_config(path))


def load_model(path: Path, plan: ModelPlan, device: str, max_positions: int) -> Transformer:
    """The checkpoint at `path` with its weights in the plan's dtype, running as the plan says;
    ValueError where a tensor is quantized, unread, or at odds with tie_word_embeddings."""
    cfg = read_config(path)
    shape, scheme = shape_of(cfg), scheme_of(cfg)
    reader = _TensorReader(_weight_files(path), getattr(torch, plan.dtype), device, scheme)
    if scheme is None:  # quantized layouts' tensors are checked as the scheme reads them
        reader.check_floats(path)
    read_layer = family_of(shape.model_type).read_layer
    layers = [read_layer(reader, shape, f"model.layers.{i}.") for i in range(shape.num_layers)]
    embed = reader.get("model.embed_tokens.weight")
    lm_head = _output_layer(reader, shape, embed, path)
    norm = reader.get("model.norm.weight")
    reader.check_all_read(path)
    return Transformer(shape, embed, layers, norm, lm_head, max_positions, plan)


def _output_layer(reader: _TensorReader, shape: ModelShape, embed: torch.Tensor, path: Path) -> torch.Tensor:
    """lm_head.weight, or the embedding where tie_word_embeddings says so (an lm_head.weight
    stored beside it must then equal it)."""
    if not shape.tie_word_embeddings:
        if "lm_head.weight" not in reader:
            raise ValueError(f"{path}: tie_word_embeddings is false (or absent, false for this family) but the "
                             "checkpoint has no lm_head.weight; set it true if the output layer is the embedding")
        return reader.get("lm_head.weight")
    if "lm_head.weight" in reader and not torch.equal(reader.get("lm_head.weight"), embed):
        raise ValueError(f"{path}: tie_word_embeddings is true but the checkpoint's lm_head.weight differs from "
                         "model.embed_tokens.weight; set it false to use the stored output layer")
    return embed
