"""Logits -> the adjusted distribution a request samples from, and seeded draws, on the logits'
device (nothing is copied to the host but the drawn token ids, by the caller).

`adjusted_probs` is the one definition of "the distribution we sample from": plain sampling
draws from it, speculative acceptance compares the target's and the proposer's (p and q).
Order: repetition penalty -> greedy (one-hot) or temperature -> top-k -> top-p -> min-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import SamplingParams


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters as tensors, for N rows of logits."""

    greedy: torch.Tensor  # [N] bool
    temperature: torch.Tensor  # [N] float32 (1.0 on greedy rows, unused there)
    top_k: torch.Tensor  # [N] int64, <= 0 disables
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    penalty: torch.Tensor  # [N] float32
    needs_sort: bool  # any row uses top-k or top-p
    needs_penalty: bool
    needs_min_p: bool
    any_greedy: bool

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device | str) -> SamplingRows:
        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            greedy=col([p.greedy for p in params], torch.bool),
            temperature=col([p.temperature if not p.greedy else 1.0 for p in params], torch.float32),
            top_k=col([p.top_k for p in params], torch.long),
            top_p=col([p.top_p for p in params], torch.float32),
            min_p=col([p.min_p for p in params], torch.float32),
            penalty=col([p.repetition_penalty for p in params], torch.float32),
            needs_sort=any(p.top_k > 0 or p.top_p < 1.0 for p in params if not p.greedy),
            needs_penalty=any(p.repetition_penalty != 1.0 for p in params),
            needs_min_p=any(p.min_p > 0 for p in params if not p.greedy),
            any_greedy=any(p.greedy for p in params),
        )

    @property
    def temperature_only(self) -> bool:
        """Whether every row's adjusted distribution is softmax(logits / temperature), or one-hot
        at the argmax on greedy rows: nothing reorders, cuts or penalises the logits."""
        return not (self.needs_sort or self.needs_penalty or self.needs_min_p)

    def repeat_rows(self, n: int) -> SamplingRows:
        """Each row repeated n times in place (row i -> rows i*n .. i*n+n-1)."""
        return SamplingRows(**{k: v.repeat_interleave(n) if isinstance(v, torch.Tensor) else v
                               for k, v in vars(self).items()})


def context_mask(contexts: list[list[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, vocab] bool: True where the token occurs in the row's context."""
    mask = torch.zeros(len(contexts), vocab_size, dtype=torch.bool, device=device)
    width = max((len(c) for c in contexts), default=0)
    if width == 0:
        return mask
    ids = torch.tensor([c + [c[0] if c else 0] * (width - len(c)) for c in contexts], device=device)
    filled = torch.tensor([len(c) > 0 for c in contexts], device=device)[:, None]  # [N, 1]
    mask.scatter_(1, ids, filled.expand_as(ids))
    return mask


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32, seen [N, V] bool, penalty [N] -> penalised logits [N, V]."""
    pen = penalty[:, None]
    penalised = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, penalised, logits)


def adjusted_probs(logits: torch.Tensor, rows: SamplingRows, seen: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V] (any float dtype) -> probabilities [N, V] float32 each row sums to 1.

    seen: [N, V] bool context presence for the repetition penalty (None when no row uses it).
    Greedy rows become one-hot at the argmax of the penalised logits.
    """
    logits = logits.float()
    if rows.needs_penalty and seen is not None:
        logits = apply_repetition_penalty(logits, seen, rows.penalty)
    vocab = logits.shape[-1]
    scaled = logits / rows.temperature[:, None]  # [N, V]
    if rows.needs_sort:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [N, V] each
        ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
        k = torch.where(rows.top_k > 0, rows.top_k, vocab)[:, None]  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)  # [N, V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V]
        sorted_logits = sorted_logits.masked_fill(mass_before >= rows.top_p[:, None], float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)  # [N, V]
    if rows.needs_min_p:
        floor = rows.min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # [N, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if rows.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(rows.greedy[:, None], one_hot, probs)
    return probs


def draw(probs: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
         rows: list[int] | None = None) -> torch.Tensor:
    """probs [N, V] -> token ids [N] on probs' device: the argmax of greedy rows (one-hot), and for
    each other row among `rows` (default all) the inverse CDF at a uniform from its own generator
    (on the same device: seeded draws reproduce per device); rows outside keep the argmax."""
    tokens = probs.argmax(dim=-1)  # [N]
    sampled = [i for i in (range(len(params)) if rows is None else rows) if not params[i].greedy]
    if sampled:
        index = torch.tensor(sampled, device=probs.device)  # [S]
        uniforms = torch.cat([torch.rand(1, generator=generators[i], device=probs.device) for i in sampled])  # [S]
        cdf = probs[index].cumsum(dim=-1)  # [S, V]
        picks = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]  # first cdf > u
        tokens[index] = picks.clamp_(max=probs.shape[-1] - 1)
    return tokens


def greedy_or_sample(logits: torch.Tensor, params: list[SamplingParams], contexts: list[list[int]],
                     generators: list[torch.Generator]) -> torch.Tensor:
    """The plain-decode sampling step for N rows: logits [N, V] -> N token ids [N] (device)."""
    if not any(p.needs_probs for p in params):
        return logits.argmax(dim=-1)  # fast path: nothing to adjust
    rows = SamplingRows.build(params, logits.device)
    seen = context_mask(contexts, logits.shape[-1], logits.device) if rows.needs_penalty else None
    return draw(adjusted_probs(logits, rows, seen), params, generators)
