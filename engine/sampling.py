"""Logits -> the adjusted distribution a request samples from, and seeded draws, on the logits'
device (nothing is copied to the host but the drawn token ids, by the caller; the inputs go up
through `host_sync.upload`).

`adjusted_probs` is the one definition of "the distribution we sample from": plain sampling
draws from it, speculative acceptance compares the target's and the proposer's (p and q).
Order: logit_bias -> repetition penalty -> presence and frequency penalties -> greedy (one-hot) or
temperature -> top-k -> top-p -> min-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import host_sync
from engine.sampling_params import SamplingParams
from engine.uniforms import RandomStream, draw_uniforms


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters as tensors, for N rows of logits."""

    greedy: torch.Tensor  # [N] bool
    temperature: torch.Tensor  # [N] float32 (1.0 on greedy rows, unused there)
    top_k: torch.Tensor  # [N] int64, <= 0 disables
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    penalty: torch.Tensor  # [N] float32
    presence: torch.Tensor  # [N] float32
    frequency: torch.Tensor  # [N] float32
    needs_sort: bool  # any row uses top-k or top-p
    needs_penalty: bool  # the repetition penalty
    needs_min_p: bool
    any_greedy: bool
    needs_counts: bool = False  # presence or frequency penalties (the output's token counts)
    needs_bias: bool = False  # logit_bias

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device | str) -> SamplingRows:
        # one upload: every column as float32 (top-k and the greedy flag are exact there)
        columns = host_sync.upload([[float(p.greedy) for p in params],
                                    [p.temperature if not p.greedy else 1.0 for p in params],
                                    [p.top_k for p in params], [p.top_p for p in params],
                                    [p.min_p for p in params], [p.repetition_penalty for p in params],
                                    [p.presence_penalty for p in params], [p.frequency_penalty for p in params]],
                                   device, torch.float32)  # [8, N]
        greedy, temperature, top_k, top_p, min_p, penalty, presence, frequency = columns
        return cls(
            greedy=greedy > 0,
            temperature=temperature,
            top_k=top_k.long(),
            top_p=top_p,
            min_p=min_p,
            penalty=penalty,
            presence=presence,
            frequency=frequency,
            needs_sort=any(p.top_k > 0 or p.top_p < 1.0 for p in params if not p.greedy),
            needs_penalty=any(p.repetition_penalty != 1.0 for p in params),
            needs_min_p=any(p.min_p > 0 for p in params if not p.greedy),
            any_greedy=any(p.greedy for p in params),
            needs_counts=any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params),
            needs_bias=any(p.logit_bias is not None for p in params),
        )

    @property
    def temperature_only(self) -> bool:
        """Whether every row's adjusted distribution is softmax(logits / temperature), or one-hot
        at the argmax on greedy rows: nothing reorders, cuts or penalises the logits."""
        return not (self.needs_sort or self.needs_penalty or self.needs_min_p or self.needs_counts or self.needs_bias)

    def repeat_rows(self, n: int | torch.Tensor) -> SamplingRows:
        """Each row repeated n times in place (row i -> rows i*n .. i*n+n-1); n may be a tensor
        [N] of counts per row."""
        return SamplingRows(**{k: v.repeat_interleave(n) if isinstance(v, torch.Tensor) else v
                               for k, v in vars(self).items()})


def context_mask(contexts: list[list[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, vocab] bool: True where the token occurs in the row's context."""
    width = max((len(c) for c in contexts), default=0)
    if width == 0:
        return torch.zeros(len(contexts), vocab_size, dtype=torch.bool, device=device)
    # short rows are padded with id `vocab_size`, which marks a spare column that is cut off
    ids = host_sync.upload([c + [vocab_size] * (width - len(c)) for c in contexts], device, torch.int64)  # [N, W]
    mask = torch.zeros(len(contexts), vocab_size + 1, dtype=torch.bool, device=device)  # [N, vocab + 1]
    return mask.scatter_(1, ids, True)[:, :vocab_size]


def output_counts(outputs: list[list[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, vocab] float32: how often each token occurs in the row's output."""
    width = max((len(o) for o in outputs), default=0)
    counts = torch.zeros(len(outputs), vocab_size + 1, dtype=torch.float32, device=device)  # [N, vocab + 1]
    if width:  # short rows padded with id `vocab_size`: a spare column, cut off
        ids = host_sync.upload([o + [vocab_size] * (width - len(o)) for o in outputs], device, torch.int64)  # [N, W]
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def bias_rows(params: list[SamplingParams], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, vocab] float32: each row's logit_bias (0 elsewhere), from one upload."""
    entries = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    bias = torch.zeros(len(params) * vocab_size, dtype=torch.float32, device=device)
    if entries:
        flat = host_sync.upload([[i * vocab_size + t for i, t, _ in entries], [b for *_, b in entries]], device,
                                torch.float64)  # [2, E]: ids exact in float64
        bias.index_put_((flat[0].long(),), flat[1].float())
    return bias.view(len(params), vocab_size)


@dataclass
class Adjustments:
    """What shifts N rows' logits before temperature, None where no row uses it: the context's
    presence (repetition penalty), the output's token counts (presence and frequency penalties),
    logit_bias."""

    seen: torch.Tensor | None = None  # [N, V] bool
    counts: torch.Tensor | None = None  # [N, V] float32
    bias: torch.Tensor | None = None  # [N, V] float32

    @classmethod
    def build(cls, rows: SamplingRows, params: list[SamplingParams], contexts: list[list[int]],
              outputs: list[list[int]], vocab_size: int, device: torch.device | str) -> Adjustments | None:
        """Those `rows` needs (contexts: prompt and output; outputs: the output alone), or None."""
        if not (rows.needs_penalty or rows.needs_counts or rows.needs_bias):
            return None
        return cls(context_mask(contexts, vocab_size, device) if rows.needs_penalty else None,
                   output_counts(outputs, vocab_size, device) if rows.needs_counts else None,
                   bias_rows(params, vocab_size, device) if rows.needs_bias else None)

    def add_tokens(self, tokens: torch.Tensor) -> None:
        """tokens [N] join each row's context and output (a drafted token, before the next draw)."""
        if self.seen is not None:
            self.seen.scatter_(1, tokens[:, None], True)
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens[:, None], torch.ones(tokens.shape[0], 1, device=tokens.device))

    def grown(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Adjustments:
        """For each row's K + 1 positions (rows i*(K+1) .. i*(K+1)+K): position j's context and
        output also hold tokens[:, :j] (proposals), as far as lengths [N] reaches; tokens [N, K]."""
        n, k = tokens.shape
        later = torch.arange(1, k + 1, device=tokens.device)[None, :] <= lengths[:, None]  # [N, K]: t_j joins
        added = None
        if self.seen is not None or self.counts is not None:
            vocab = (self.seen if self.seen is not None else self.counts).shape[-1]
            added = torch.zeros(n, k + 1, vocab, dtype=torch.float32, device=tokens.device)  # [N, K+1, V]
            added[:, 1:].scatter_(2, tokens[:, :, None], later[:, :, None].float())
            added = added.cumsum(dim=1)  # position j: how often each token occurs among t_1..t_j

        def repeat(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, None, :].expand(n, k + 1, t.shape[-1]).reshape(n * (k + 1), -1)

        seen = None if self.seen is None else (repeat(self.seen) | (added.reshape(n * (k + 1), -1) > 0))
        counts = None if self.counts is None else repeat(self.counts) + added.reshape(n * (k + 1), -1)
        return Adjustments(seen, counts, repeat(self.bias))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32, seen [N, V] bool, penalty [N] -> penalised logits [N, V]."""
    pen = penalty[:, None]
    penalised = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, penalised, logits)


def adjusted_logits(logits: torch.Tensor, rows: SamplingRows, adjust: Adjustments | None) -> torch.Tensor:
    """logits [N, V] -> float32 [N, V] with logit_bias, the repetition penalty and the presence and
    frequency penalties applied."""
    logits = logits.float()
    if adjust is None:
        return logits
    if rows.needs_bias and adjust.bias is not None:
        logits = logits + adjust.bias
    if rows.needs_penalty and adjust.seen is not None:
        logits = apply_repetition_penalty(logits, adjust.seen, rows.penalty)
    if rows.needs_counts and adjust.counts is not None:
        logits = logits - rows.frequency[:, None] * adjust.counts - rows.presence[:, None] * (adjust.counts > 0)
    return logits


def adjusted_probs(logits: torch.Tensor, rows: SamplingRows, adjust: Adjustments | None) -> torch.Tensor:
    """logits [N, V] (any float dtype) -> probabilities [N, V] float32 each row sums to 1.

    adjust: what shifts the logits first (adjusted_logits; None when no row uses any). Greedy
    rows become one-hot at the argmax of the shifted logits.
    """
    logits = adjusted_logits(logits, rows, adjust)
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


def draw(probs: torch.Tensor, params: list[SamplingParams], streams: list[RandomStream],
         rows: list[int] | None = None) -> torch.Tensor:
    """probs [N, V] -> token ids [N] on probs' device: the argmax of greedy rows (one-hot), and for
    each other row among `rows` (default all) the inverse CDF at the next uniform of its stream;
    rows outside keep the argmax. The uniforms come from one `draw_uniforms` call."""
    sampled = [i for i in (range(len(params)) if rows is None else rows) if not params[i].greedy]
    if not sampled:
        return probs.argmax(dim=-1)
    uniforms = draw_uniforms([streams[i] for i in sampled], 1, probs.device)[:, 0]  # [S]
    if sampled == list(range(len(params))):
        return inverse_cdf(probs, uniforms)
    index = host_sync.upload(sampled, probs.device, torch.int64)  # [S]
    return probs.argmax(dim=-1).index_copy_(0, index, inverse_cdf(probs[index], uniforms))  # [N]


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (rows summing to about 1), uniforms [N] in [0, 1) -> token ids [N]: the first
    token whose cumulative probability exceeds u times the row's total (a one-hot row gives its hot
    token at any u)."""
    cdf = probs.cumsum(dim=-1)  # [N, V]
    picks = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]  # [N]
    return picks.clamp_(max=probs.shape[-1] - 1)


def greedy_or_sample(logits: torch.Tensor, params: list[SamplingParams], contexts: list[list[int]],
                     streams: list[RandomStream], outputs: list[list[int]] | None = None,
                     keep_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain-decode sampling step for N rows: logits [N, V] -> N token ids [N] (device), and
    with keep_probs the adjusted distribution they were drawn from [N, V]. contexts: each row's
    prompt and output; outputs: the output alone (presence and frequency penalties)."""
    if not keep_probs and not any(p.needs_probs for p in params):
        return logits.argmax(dim=-1), None  # fast path: nothing to adjust
    rows = SamplingRows.build(params, logits.device)
    adjust = Adjustments.build(rows, params, contexts, outputs if outputs is not None else [[] for _ in params],
                               logits.shape[-1], logits.device)
    probs = adjusted_probs(logits, rows, adjust)
    return draw(probs, params, streams), probs if keep_probs else None
