"""Logprobs in OpenAI's two shapes: completions' (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`) and chat's (`content`: one entry per token with `token`, `logprob`, `bytes` and
`top_logprobs`). A token's text is its own decode; a logprob of -inf (a token the processed
distribution excludes) is written as -9999.0, as vLLM does, since JSON has no infinity."""

from __future__ import annotations

import math

from engine.logprobs import TokenLogprob
from engine.tokenizer import Tokenizer

FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class TokenTexts:
    """Each token id's text, decoded once per id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.hf.decode([token_id], skip_special_tokens=False,
                                                                      clean_up_tokenization_spaces=False)
        return text


def completion_logprobs(texts: TokenTexts, entries: list[TokenLogprob | None], offset: int = 0) -> dict:
    """Completions' shape for `entries` (None: a prompt's first token, which has no logprob);
    text_offset counts characters from `offset`."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        if entry is None:
            continue
        text = texts(entry.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(entry.logprob))
        out["top_logprobs"].append({texts(t): _finite(lp) for t, lp in entry.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def prompt_completion_logprobs(texts: TokenTexts, prompt: list[int], entries: list[TokenLogprob | None]) -> dict:
    """Completions' shape for an echoed prompt: its first token listed with logprob null."""
    out = completion_logprobs(texts, entries)
    first = texts(prompt[0])
    out["text_offset"] = [0] + [o + len(first) for o in out["text_offset"]]
    out["tokens"].insert(0, first)
    out["token_logprobs"].insert(0, None)
    out["top_logprobs"].insert(0, None)
    return out


def join(first: dict, second: dict) -> dict:
    """Two completions-shaped runs one after the other (the echoed prompt, then the output)."""
    shift = (first["text_offset"][-1] + len(first["tokens"][-1])) if first["tokens"] else 0
    return {"tokens": first["tokens"] + second["tokens"],
            "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
            "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]]}


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        text = texts(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}
