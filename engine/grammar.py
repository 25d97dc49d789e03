"""Structured outputs: a request's grammar (JSON, a JSON schema, a regex or a choice list), compiled
by xgrammar, and the per-request matcher whose token masks restrict the target's distribution.

A matcher's committed state follows the request's output tokens (the engine accepts each token it
appends); proposers and the verify pass walk ahead of it and roll back. Masked-out tokens get
logit -inf before any other adjustment, so a constrained request samples from the target's
distribution restricted to the grammar and renormalised, with speculation on or off.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from engine.model.tokenizer import Tokenizer
from engine.structured_output import StructuredOutput


class GrammarError(ValueError):
    """A grammar that cannot be compiled; `param` names the request field it came from."""

    param = "structured_output"


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer and logits width; xgrammar caches by grammar."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import xgrammar  # imported on the first constrained request: no cost for engines without one

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(tokenizer.eos_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        try:
            compiled = self._compile(spec)
        except RuntimeError as exc:  # xgrammar reports bad schemas and regexes as RuntimeErrors
            raise GrammarError(f"{spec.kind}: {str(exc).splitlines()[0].split('] ')[-1]}") from None
        return GrammarMatcher(self._xgr.GrammarMatcher(compiled), self.vocab_size)  # rollback unbounded

    def _compile(self, spec: StructuredOutput):
        # compact JSON: a free-whitespace grammar lets a small model pad a document forever
        if spec.kind == "json_object":
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            return self._compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.value)
        return self._compiler.compile_regex("|".join(_regex_literal(c) for c in json.loads(spec.value)))


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in text)


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, and accepting or undoing tokens.
    `commit` advances it with the request's output; proposers and the verify pass `accept` ahead
    and `rollback`. Masks travel as xgrammar's packed bitmask rows (int32 [ceil(V / 32)], bit j of
    word w: token 32 w + j), unpacked once per batch; the masks of a step's walks ahead are kept
    until the next commit, so the verify pass reuses the ones the draft filled."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._ahead: list[int] = []  # tokens accepted past the committed state
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}  # tokens ahead -> packed mask [W]

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row] (int32 [N, W]): only the grammar's stop
        tokens once it is complete; every token after a stop token (what follows it is dropped)."""
        if self.terminated:
            bitmask[row] = -1
            return
        known = self._masks.get(tuple(self._ahead))
        if known is not None:
            bitmask[row] = known
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._masks[tuple(self._ahead)] = bitmask[row].clone()

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens allowed next."""
        bitmask = new_bitmask(1, self.vocab_size)
        self.fill(bitmask, 0)
        return unpack_bitmask(bitmask, self.vocab_size)[0]

    def commit(self, token: int) -> bool:
        """Advances past the request's next output token; False (state unchanged) if not allowed."""
        self._masks.clear()
        return self._matcher.accept_token(token)

    def accept(self, token: int) -> bool:
        """Walks ahead past a proposed token (undone by `rollback`); False if not allowed."""
        if not self._matcher.accept_token(token):
            return False
        self._ahead.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._ahead[-num_tokens:]

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def walk(self, tokens: list[int], bitmask: torch.Tensor) -> int:
        """How many of `tokens` the grammar allows in a row (n); bitmask[j] (int32 [>= n + 1, W]) gets
        the mask after tokens[:j] for j = 0..n. The state is left as it was."""
        accepted = 0
        for j, token in enumerate([*tokens, None]):
            self.fill(bitmask, j)
            if token is None or not int(bitmask[j, token >> 5]) >> (token & 31) & 1 or not self.accept(token):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(V / 32)] on the host (where xgrammar fills it), every token allowed."""
    return torch.from_numpy(np.full((rows, -(-vocab_size // 32)), -1, dtype=np.int32))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed masks int32 [..., ceil(V / 32)] -> bool [..., V] (one C call: masks are per token)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")  # [..., 32 W]
    return torch.from_numpy(bits[..., :vocab_size].view(np.bool_))


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with -inf where `allowed` [..., V] is False."""
    return torch.where(allowed.to(logits.device), logits, float("-inf"))


def mask_rows(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """logits [N, V] with each constrained row restricted to what its grammar allows now."""
    if all(m is None for m in matchers):
        return logits
    bitmask = new_bitmask(len(matchers), logits.shape[-1])  # [N, W]
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill(bitmask, i)
    return mask_logits(logits, unpack_bitmask(bitmask, logits.shape[-1]))


def cut_proposals(matchers: list[GrammarMatcher | None], tokens: list[list[int]],
                  vocab_size: int) -> tuple[list[list[int]], torch.Tensor]:
    """Each row's proposal cut before the first token its grammar forbids, and the verify pass's
    masks [N, K + 1, V] (K: the longest cut proposal; True on unconstrained rows)."""
    bitmask = new_bitmask(len(tokens) * (max(map(len, tokens)) + 1), vocab_size).view(
        len(tokens), -1, -(-vocab_size // 32))  # [N, K_in + 1, W]
    cut = [t if m is None else t[:m.walk(t, bitmask[i])] for i, (m, t) in enumerate(zip(matchers, tokens))]
    width = max(map(len, cut)) + 1
    return cut, unpack_bitmask(bitmask[:, :width], vocab_size)
