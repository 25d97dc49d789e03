"""Logprobs of the tokens a request emits (and of its prompt's tokens), with their top alternatives,
taken from the target's distribution at each position: in a speculative round from the verify
pass (never the proposer's). Computed on the device and read back with the tokens in the same
transfer: a table row per token, (token id, its logprob, k top ids, k top logprobs) in float64,
which holds both ids and float32 logprobs exactly.

Which distribution (`EngineConfig.logprobs_mode`): "raw", the model's own (log_softmax of its
logits, before logit_bias, penalties, temperature, top-k/top-p/min-p and structured-output masks),
or "processed", the one the token was drawn from (one-hot for greedy rows)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the most likely tokens, most likely first


def log_distribution(raw_logits: torch.Tensor, probs: torch.Tensor | None, mode: str) -> torch.Tensor:
    """[M, V] float32 logprobs: log_softmax(raw_logits) ("raw"), or log(probs) ("processed")."""
    if mode == "raw":
        return raw_logits.float().log_softmax(dim=-1)
    if probs is None:
        raise ValueError("logprobs_mode 'processed' needs the adjusted probabilities")
    return probs.float().log()


def table(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logprobs [M, V], tokens [M] -> [M, 2 + 2k] float64: token id, its logprob, the k most likely
    ids, their logprobs."""
    chosen = logprobs.gather(1, tokens[:, None])  # [M, 1]
    top_values, top_ids = logprobs.topk(k, dim=-1)  # [M, k] each
    return torch.cat([tokens[:, None].double(), chosen.double(), top_ids.double(), top_values.double()], dim=1)


def row_logprob(values: list[float], k: int, wanted: int) -> TokenLogprob:
    """A table row (as read back) -> the token's TokenLogprob with its `wanted` (<= k) top alternatives."""
    ids, lps = values[2:2 + k], values[2 + k:2 + 2 * k]
    return TokenLogprob(int(values[0]), float(values[1]), tuple((int(i), float(v)) for i, v in zip(ids[:wanted], lps)))


def most_wanted(values: list[int | None]) -> int | None:
    """The most top alternatives any row asks for; None when no row asks for logprobs."""
    asked = [v for v in values if v is not None]
    return max(asked) if asked else None
