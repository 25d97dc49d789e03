"""Tokenizer access through `transformers.AutoTokenizer`, plus EOS ids and chat prompts."""

from __future__ import annotations

import json
from pathlib import Path


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


class Tokenizer:
    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.path = Path(path)
        self.hf = AutoTokenizer.from_pretrained(str(path))
        eos: set[int] = _as_id_set(self.hf.eos_token_id)
        for name in ("config.json", "generation_config.json"):
            f = self.path / name
            if f.exists():
                eos |= _as_id_set(json.loads(f.read_text()).get("eos_token_id"))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer at {self.path} has no chat template")
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # BatchEncoding in newer transformers
            out = out["input_ids"]
        return list(out)
