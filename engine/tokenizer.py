"""The checkpoint's tokenizer (transformers), its EOS ids and chat template, and incremental
detokenization with stop strings for streaming.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


def _as_id_set(value) -> set[int]:
    return set() if value is None else {value} if isinstance(value, int) else {int(v) for v in value}


@dataclass(frozen=True)
class ChatPrompt:
    """A prompt given as a conversation: its messages (and tools, for templates that render them)
    through the checkpoint's chat template, the assistant's turn opened (`Tokenizer.apply_chat_template`)."""

    messages: list[dict]
    tools: list[dict] | None = None


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
        _check_unicode("prompt", text)
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt's ids: `messages` (and the functions in `tools`, for templates that render
        them) through the checkpoint's chat template, with the assistant's turn opened."""
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer at {self.path} has no chat template")
        _check_texts("messages", messages)
        _check_texts("tools", tools)
        out = self.hf.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # BatchEncoding in newer transformers
            out = out["input_ids"]
        return list(out)


def _check_texts(field: str, value) -> None:
    """_check_unicode over every string in nested lists and dicts (the field named by its path)."""
    if isinstance(value, str):
        _check_unicode(field, value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_texts(f"{field}.{key}", item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_texts(f"{field}[{i}]", item)


def _check_unicode(field: str, text: str) -> None:
    """ValueError naming `field` when `text` holds a lone surrogate (JSON's "\\ud800" decodes to one):
    no UTF-8 encoding exists, so no tokenizer can read it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} is not valid Unicode text: {exc.reason} at position {exc.start}") from None


class IncrementalText:
    """A request's text as its tokens arrive: never a partial UTF-8 character, never half a stop
    string (the last len(longest stop) - 1 characters are held back); the streamed pieces
    concatenate to the full decode of the output, cut at the stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self._tok = tokenizer
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # decode window start
        self._read_offset = 0  # tokens already turned into `text`
        self.text = ""  # all decoded text so far (may include held-back tail)
        self._emitted = 0  # chars of `text` handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feeds one token; returns the newly streamable text. Sets `stopped` on a stop string."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            search_from = max(0, len(self.text) - self._holdback)
            self.text += new
            for s in self._stop:
                at = self.text.find(s, search_from)
                if at != -1:
                    self.text = self.text[:at]
                    self.stopped = True
            if self.stopped:
                return self._release(len(self.text))
        return self._release(len(self.text) - self._holdback)

    def finish(self) -> str:
        """Everything not yet emitted (call once, when the request ends)."""
        if not self.stopped:
            self.text = self._tok.decode(self._ids)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted:upto]
        self._emitted = upto
        return out
