"""Structured outputs: a request's grammar (JSON, a JSON schema, a regex or a choice list), compiled
by xgrammar, and the per-request matcher whose token masks restrict the target's distribution.

A matcher's committed state follows the request's output tokens (the engine accepts each token it
appends); proposers and the verify pass walk ahead of it and roll back. Masked-out tokens get
logit -inf before any other adjustment, so a constrained request samples from the target's
distribution restricted to the grammar and renormalised, with speculation on or off.
"""

from __future__ import annotations

import json

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
    """One request's grammar state: which tokens may come next, and accepting or undoing tokens."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = torch.zeros(1, -(-vocab_size // 32), dtype=torch.int32)  # [1, ceil(V / 32)]

    def allowed(self) -> torch.Tensor:
        """[V] bool: tokens the grammar allows next (only its stop tokens once it is complete; all
        after a stop token, since whatever follows it is dropped)."""
        if self.terminated:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return unpack_bitmask(self._bitmask, self.vocab_size)[0]

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def walk(self, tokens: list[int]) -> tuple[int, torch.Tensor]:
        """How many of `tokens` the grammar allows in a row (n), and the masks at positions 0..n
        [n + 1, V] (mask j: after tokens[:j]); the state is left as it was."""
        masks, accepted = [], 0
        for token in [*tokens, None]:
            masks.append(self.allowed())
            if token is None or not masks[-1][token] or not self.accept(token):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted, torch.stack(masks)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [N, ceil(V / 32)] (bit j of word w: token 32 w + j) -> bool [N, V]."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab_size]


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with -inf where `allowed` [..., V] is False."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def mask_rows(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """logits [N, V] with each constrained row restricted to what its grammar allows now."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    allowed = torch.ones(logits.shape, dtype=torch.bool)  # [N, V]
    for i in rows:
        allowed[i] = matchers[i].allowed()
    return mask_logits(logits, allowed)


def cut_proposals(matchers: list[GrammarMatcher | None], tokens: list[list[int]],
                  vocab_size: int) -> tuple[list[list[int]], torch.Tensor]:
    """Each row's proposal cut before the first token its grammar forbids, and the verify pass's
    masks [N, K + 1, V] (K: the longest cut proposal; True on unconstrained rows)."""
    walks = [(len(t), None) if m is None else m.walk(t) for m, t in zip(matchers, tokens)]
    cut = [t[:n] for t, (n, _) in zip(tokens, walks)]
    width = max(len(t) for t in cut) + 1
    masks = torch.ones(len(tokens), width, vocab_size, dtype=torch.bool)  # [N, K + 1, V]
    for i, (n, walked) in enumerate(walks):
        if walked is not None:
            masks[i, :n + 1] = walked[:n + 1]
    return cut, masks
