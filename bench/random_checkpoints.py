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
# Qwen3-30B-A3B as published: 128 experts, top 8, 3B of its 30B parameters active a token
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=40960, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    use_sliding_window=False, sliding_window=None, max_window_layers=48)
# the reduced shape the CPU runs: the real routing (128 experts, top 8), narrow layers
REDUCED_MOE = {**QWEN3_30B_A3B, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
               "moe_intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 32}
SMOKE_MOE = {**REDUCED_MOE, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "head_dim": 16}

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
    """A transformers model's tensors by checkpoint name (shared, not copied): a mixture of
    experts' stacked weights as the published per-expert tensors, views of them."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 I, hidden]: each expert's gate rows, then its up rows
            base, inner = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = t[e, :inner], t[e, inner:]
        elif name.endswith("mlp.experts.down_proj"):  # [E, hidden, I]
            out.update({f"{name.removesuffix('down_proj')}{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


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
    """Tensor name -> shape of a Llama, Qwen3 or Qwen3-MoE checkpoint with this config."""
    H, V = config["hidden_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or H // heads
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = (V, H)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (heads * d, H), p + "self_attn.k_proj.weight": (kv * d, H),
                    p + "self_attn.v_proj.weight": (kv * d, H), p + "self_attn.o_proj.weight": (H, heads * d)})
        if config["model_type"] in ("qwen3", "qwen3_moe"):
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        out.update(_mlp_shapes(config, p))
    return out


def _mlp_shapes(config: dict, p: str) -> dict[str, tuple[int, ...]]:
    """A layer's MLP tensors: dense SwiGLU, or a Qwen3-MoE router and experts."""
    H = config["hidden_size"]
    if config["model_type"] != "qwen3_moe":
        inter = config["intermediate_size"]
        return {p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                p + "mlp.down_proj.weight": (H, inter)}
    E, inter = config["num_experts"], config["moe_intermediate_size"]
    out = {p + "mlp.gate.weight": (E, H)}
    for e in range(E):
        x = f"{p}mlp.experts.{e}."
        out.update({x + "gate_proj.weight": (inter, H), x + "up_proj.weight": (inter, H), x + "down_proj.weight": (H, inter)})
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

    class Reader(disk_reader):
        """The loader's reader, with the store's tensors served from memory."""

        def __init__(self, files: dict[str, Path], dtype: torch.dtype, device: str, scheme=None):
            super().__init__({n: p for n, p in files.items() if str(p) not in store}, dtype, device, scheme)
            self.files = files

        def raw(self, name: str) -> torch.Tensor:
            tensors = store.get(str(self.files.get(name)))
            if tensors is None:
                return super().raw(name)
            self.read.add(name)
            return tensors[name].to(device=self.device)

    loader._weight_files, loader._TensorReader = weight_files, Reader
    try:
        yield
    finally:
        loader._weight_files, loader._TensorReader = files_of, disk_reader
