"""Random-weight checkpoints built where the check runs, with no shipped weights: a directory holds a
real config.json and tokenizer, and its tensors live in memory (on the device), served to the
engine's loader by `weights_in_memory`. A prefix draft shares its target's embedding, first layers,
norm and head, so its acceptance grows with the layers it keeps (all of them: the identical draft)."""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

import engine.model.loader as loader

# Llama-3.2-1B and Llama-3.1-8B as published (config.json), less the token ids
LLAMA_3_2_1B = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    hidden_act="silu", attention_bias=False, mlp_bias=False)
LLAMA_3_1_8B = {**LLAMA_3_2_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "head_dim": 128, "tie_word_embeddings": False,
                "rope_scaling": {**LLAMA_3_2_1B["rope_scaling"], "factor": 8.0}}
# the same layout at a size a 2-core CPU runs in seconds (the smoke run)
SMOKE_1B = {**LLAMA_3_2_1B, "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}
SMOKE_8B = {**SMOKE_1B, "num_hidden_layers": 2, "tie_word_embeddings": False}

Store = dict[str, Mapping[str, torch.Tensor]]  # checkpoint directory -> its tensors by HF name


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id ("t0" .. "t{V-1}"): any id decodes, nothing merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", pad_token="t2").save_pretrained(path)


def write_config(path: Path, config: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config, "bos_token_id": 0, "eos_token_id": 1,
                                                  "pad_token_id": 2, "torch_dtype": "bfloat16"}, indent=1))


def hf_model(config: dict, dtype: torch.dtype, device: str, seed: int = 0):
    """A transformers model of `config`, random init (transformers' own), on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"},
                               bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def hf_tensors(model) -> dict[str, torch.Tensor]:
    """A transformers model's tensors by checkpoint name (shared, not copied)."""
    return {name: t.detach() for name, t in model.state_dict().items()}


class RandomTensors(Mapping):
    """A checkpoint's tensors made on first read (normal, std 0.02; norms ones), never all held at
    once: the engine fuses each layer's as it loads, so peak memory stays near one copy."""

    def __init__(self, config: dict, dtype: torch.dtype, device: str):
        self.shapes = checkpoint_shapes(config)
        self.dtype, self.device = dtype, device

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        g = torch.Generator(device=self.device).manual_seed(zlib.crc32(name.encode()))
        return (0.02 * torch.randn(shape, generator=g, device=self.device, dtype=torch.float32)).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Llama checkpoint with this config."""
    H, inter, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or H // heads
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = (V, H)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (heads * d, H), p + "self_attn.k_proj.weight": (kv * d, H),
                    p + "self_attn.v_proj.weight": (kv * d, H), p + "self_attn.o_proj.weight": (H, heads * d),
                    p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                    p + "mlp.down_proj.weight": (H, inter)})
    return out


def prefix_draft(config: dict, tensors: Mapping[str, torch.Tensor], layers: int) -> tuple[dict, dict]:
    """A draft of the target's embedding, first `layers` layers, final norm and head: its config and
    tensors (the target's own, not copies)."""
    keep = tuple(f"model.layers.{i}." for i in range(layers))
    names = [n for n in tensors if not n.startswith("model.layers.") or n.startswith(keep)]
    return {**config, "num_hidden_layers": layers}, {n: tensors[n] for n in names}


def checkpoint_dir(path: Path, config: dict, tokenizer_from: Path | None = None) -> Path:
    """A checkpoint directory without weights: config.json and a tokenizer (copied from
    `tokenizer_from`, else written for the config's vocabulary)."""
    write_config(path, config)
    if tokenizer_from is None:
        write_tokenizer(path, config["vocab_size"])
    else:
        for f in tokenizer_from.glob("*token*"):
            (path / f.name).write_bytes(f.read_bytes())
    return path


def target_and_prefix_draft(work: Path, config: dict, tensors: Mapping[str, torch.Tensor],
                            draft_layers: int) -> tuple[Path, Path, Store]:
    """Checkpoint directories for a target of `config` and its prefix draft (its first
    `draft_layers` layers), and the store that serves both from `tensors`."""
    target = checkpoint_dir(work / "target", config)
    draft_config, draft_tensors = prefix_draft(config, tensors, draft_layers)
    draft = checkpoint_dir(work / "draft", draft_config, tokenizer_from=target)
    return target, draft, {str(target): tensors, str(draft): draft_tensors}


@contextlib.contextmanager
def weights_in_memory(store: Store) -> Iterator[None]:
    """While open, the engine's loader reads the checkpoints in `store` from memory (other
    directories from their files, as always)."""
    files_of: Callable = loader._weight_files
    disk_reader = loader._TensorReader

    def weight_files(path: Path) -> dict[str, Path]:
        tensors = store.get(str(Path(path)))
        return files_of(path) if tensors is None else {name: Path(path) for name in tensors}

    class Reader:
        def __init__(self, files: dict[str, Path], dtype: torch.dtype, device: str):
            self.files, self.dtype, self.device = files, dtype, device
            on_disk = {n: p for n, p in files.items() if str(p) not in store}
            self.disk = disk_reader(on_disk, dtype, device) if on_disk else None
            self.read: set[str] = set()

        def __contains__(self, name: str) -> bool:
            return name in self.files

        def get(self, name: str) -> torch.Tensor:
            if name not in self.files:
                raise KeyError(f"tensor {name!r} missing from the checkpoint")
            tensors = store.get(str(self.files[name]))
            if tensors is None:
                return self.disk.get(name)
            self.read.add(name)
            return tensors[name].to(device=self.device, dtype=self.dtype)

        def linear(self, module: str) -> torch.Tensor:
            return self.get(module + ".weight")

        def check_floats(self, where: Path) -> None:  # the store holds the floats this module made
            if self.disk is not None:
                self.disk.check_floats(where)

        def check_all_read(self, where: Path) -> None:
            unread = sorted({n for n, p in self.files.items() if str(p) in store} - self.read)
            if unread:
                raise ValueError(f"{where}: tensors the forward does not read: {unread[:4]}")
            if self.disk is not None:
                self.disk.check_all_read(where)

    loader._weight_files, loader._TensorReader = weight_files, Reader
    try:
        yield
    finally:
        loader._weight_files, loader._TensorReader = files_of, disk_reader
