"""Tiny random checkpoints (Llama, Mistral, Qwen2, Qwen3) and a tiny tokenizer, built on disk for tests."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nprint(os.path.join('a', 'b'))\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 🚀 текст",
]


# per family, the config fields that set it apart in published checkpoints (head_dim: Qwen3's
# default is 128, so tiny models give theirs)
FAMILIES = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=None),  # v0.2 on: full attention
    "qwen2": dict(model_type="qwen2", use_sliding_window=False, sliding_window=4096, max_window_layers=2),
    "qwen3": dict(model_type="qwen3", head_dim=16),
}


def make_tokenizer(path: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|endoftext|>"]  # the last: a Qwen2 tokenizer adds it when missing
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)
    fast.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                          "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    fast.save_pretrained(path)
    return fast


def make_model(path: Path, tokenizer_dir: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, intermediate: int = 128, tied: bool = False,
               rope_scaling: dict | None = None, max_pos: int = 512, dtype=torch.float32,
               vocab_size: int | None = None, model_type: str = "llama", **family):
    """Saves a random-init HF causal LM of `model_type` (llama, mistral, qwen2, qwen3; `family`:
    more config fields) with the tokenizer; returns the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab_size or len(tok), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
        tie_word_embeddings=tied, max_position_embeddings=max_pos, rope_scaling=rope_scaling,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **family,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():  # larger-than-default weights so random models are far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(2.5)
            elif name.endswith(".bias"):  # zero at init: random, or a bias would test nothing
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # ones at init: one scale per channel
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model


def pool_for(model, backend: str = "paged", max_slots: int = 4, max_seq_len: int = 256, block_size: int = 16):
    """A KV pool shaped for `model` (no prefix cache)."""
    from engine.model.passes import pool_for as engine_pool_for

    return engine_pool_for(model, max_slots, max_seq_len, backend, block_size)


class InMemoryRecorder:
    """A Recorder that keeps values in dicts (tests, the stats endpoint)."""

    def __init__(self):
        self.counters: dict[tuple, float] = {}
        self.gauges: dict[tuple, float] = {}
        self.observations: dict[tuple, list[float]] = {}

    @staticmethod
    def _key(name: str, labels: dict[str, str]) -> tuple:
        return (name, *sorted(labels.items()))

    def inc(self, name, value, labels):
        key = self._key(name, labels)
        self.counters[key] = self.counters.get(key, 0.0) + value

    def set(self, name, value, labels):
        self.gauges[self._key(name, labels)] = value

    def observe(self, name, value, labels):
        self.observations.setdefault(self._key(name, labels), []).append(value)

    def total(self, name: str, **labels) -> float:
        return sum(v for k, v in self.counters.items() if k[0] == name and all((lk, lv) in k[1:] for lk, lv in labels.items()))
