"""Structured outputs at run time: a request's grammar compiled by llguidance, the per-request
matcher, and the token masks that restrict the target's (and the draft's) distribution.

A matcher's committed state follows the request's output tokens (the engine commits each token it
appends); proposers and the verify pass walk ahead of it and roll back. Masked-out tokens get
logit -inf before any other adjustment, so a constrained request samples from the target's
distribution restricted to the grammar and renormalised, with speculation on or off.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from engine.structured_output import StructuredOutput
from engine.tokenizer import Tokenizer

CACHED_GRAMMARS = 256  # compiled grammars kept per engine (least recently used dropped)
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: free whitespace lets a small model pad forever


class GrammarError(ValueError):
    """A grammar that cannot be compiled or enforced; `param` names the request field it came from."""

    param = "structured_output"


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer and logits width, keeping recent ones."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import llguidance  # imported on the first constrained request: no cost for engines without one
        import llguidance.hf

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(tokenizer.eos_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size,
                                                       eos_token=sorted(tokenizer.eos_token_ids))
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()  # spec -> template LLMatcher

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for `spec`; GrammarError names what llguidance cannot enforce in it (an
        unimplemented schema keyword, an unknown format, a regex that does not parse, ...)."""
        template = self._compiled.pop(spec, None)
        if template is None:
            grammar = self._grammar(spec)
            failed, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
            if failed:
                raise GrammarError(f"{spec.kind}: {'; '.join(messages)}")
            template = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        self._compiled[spec] = template
        if len(self._compiled) > CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return GrammarMatcher(template.deep_copy(), self.vocab_size, self.stop_ids)

    def _grammar(self, spec: StructuredOutput) -> str:
        llg = self._llg
        try:
            if spec.kind in ("json_object", "json_schema"):
                return llg.LLMatcher.grammar_from_json_schema(spec.value or '{"type": "object"}', defaults=JSON_OPTIONS)
            return llg.grammar_from(spec.kind, spec.value)
        except (ValueError, RuntimeError) as exc:
            raise GrammarError(f"{spec.kind}: {exc}") from None


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, and accepting or undoing tokens.
    `commit` advances it with the request's output; proposers and the verify pass `accept` ahead
    and `rollback`. Masks travel packed (int32 [ceil(V / 32)], bit j of word w: token 32 w + j) and
    are unpacked once per batch; the masks of a step's walks ahead are kept until the next commit,
    so the verify pass reuses the ones the draft filled."""

    def __init__(self, matcher, vocab_size: int, stop_ids: frozenset[int]):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._stop_ids = stop_ids
        self._ahead: list[int] = []  # tokens accepted past the committed state
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}  # tokens ahead -> packed mask [W]

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row] (int32 [N, W], host): only the stop
        tokens once the grammar is complete; every token after a stop token (what follows it is
        dropped)."""
        if self.terminated:
            bitmask[row] = -1
            return
        known = self._masks.get(tuple(self._ahead))
        if known is not None:
            bitmask[row] = known
            return
        out = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
        self._masks[tuple(self._ahead)] = out.clone()

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens allowed next."""
        bitmask = new_bitmask(1, self.vocab_size)
        self.fill(bitmask, 0)
        return unpack_bitmask(bitmask, self.vocab_size)[0]

    def commit(self, token: int) -> bool:
        """Advances past the request's next output token; False if the grammar forbids it."""
        self._masks.clear()
        return self._matcher.consume_token(token)

    def accept(self, token: int) -> bool:
        """Walks ahead past a proposed token the grammar allows (undone by `rollback`). A stop token
        is only recorded: llguidance keeps no state for it to roll back."""
        if token in self._stop_ids and self._matcher.is_accepting():
            self._ahead.append(token)
            return True
        if not self._matcher.consume_token(token):
            return False
        self._ahead.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            stops = int(self.terminated)  # a stop token can only be the last one ahead
            if num_tokens > stops:
                self._matcher.rollback(num_tokens - stops)
            del self._ahead[-num_tokens:]

    @property
    def terminated(self) -> bool:
        """A stop token was accepted ahead (the request ends there)."""
        return bool(self._ahead) and self._ahead[-1] in self._stop_ids

    def walk(self, tokens: list[int], bitmask: torch.Tensor) -> int:
        """How many of `tokens` the grammar allows in a row, up to a stop token (n); bitmask[j] (int32 [>= n + 1, W]) gets
        the mask after tokens[:j] for j = 0..n. The state is left as it was."""
        accepted = 0
        for j, token in enumerate([*tokens, None]):
            self.fill(bitmask, j)
            if token is None or self.terminated or not int(bitmask[j, token >> 5]) >> (token & 31) & 1 \
                    or not self.accept(token):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(V / 32)] on the host (where the grammar fills it), every token allowed."""
    return torch.from_numpy(np.full((rows, -(-vocab_size // 32)), -1, dtype=np.int32))


def _forbid(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Clears `token`'s bit in bitmask[row] (int32 words: the bit pattern kept as a signed value)."""
    word = int(bitmask[row, token >> 5]) & ~(1 << (token & 31)) & 0xFFFFFFFF
    bitmask[row, token >> 5] = word - (1 << 32) if word >= 1 << 31 else word


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


def cut_tree(matcher: GrammarMatcher, tree, vocab_size: int):
    """A token tree (engine/speculative/tree.py) without the nodes its grammar forbids after their
    path (nor their subtrees, nor anything after a stop token), and the masks [n + 1, V] (bool) of
    its root and each kept node: what the grammar allows next there. A drawn tree's forbidden
    child stays, as a leaf its parent's mask rejects (its later siblings were drawn with it taken
    out of q: acceptance must try it, and reject it, before them). The matcher is left as it was."""
    from engine.token_tree import TokenTree

    tokens: list[int] = []
    parents: list[int] = []
    kept: list[int] = []  # the old node of each kept one
    bitmask = new_bitmask(len(tree) + 1, vocab_size)  # [n + 1, W], row j + 1: after kept node j

    def visit(old: int, new: int) -> None:  # the matcher stands after `new`'s path
        row = new + 1
        matcher.fill(bitmask, row)
        if matcher.terminated:
            return
        for child in tree.children[old + 1]:
            token = tree.tokens[child]
            if not int(bitmask[row, token >> 5]) >> (token & 31) & 1 or not matcher.accept(token):
                if tree.q is not None:  # a leaf (its row keeps every token: never reached)
                    _forbid(bitmask, row, token)  # never accepted, nor drawn as the correction
                    tokens.append(token)
                    parents.append(new)
                    kept.append(child)
                continue
            tokens.append(token)
            parents.append(new)
            kept.append(child)
            visit(child, len(tokens) - 1)
            matcher.rollback(1)

    visit(-1, -1)
    q_rows = None if tree.q is None else tuple(tree.q_row_of(row) for row in [0] + [c + 1 for c in kept])
    return (TokenTree(tuple(tokens), tuple(parents), tree.q, q_rows),
            unpack_bitmask(bitmask[:len(tokens) + 1], vocab_size))

