"""A request's life in the engine, and what the engine reports about it.

`Request` is the engine's mutable record of one generation; `StepOutput` is one new token (a
speculative step may emit several per request, in order); `RequestOutput` is what callers see.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from engine.config import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV
    RUNNING = "running"  # holds KV; prefilling (chunk by chunk) or decoding
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Per-request speculation record (acceptance by round)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    proposed_per_round: list[int] = field(default_factory=list)
    proposers: set[str] = field(default_factory=set)

    @property
    def rounds(self) -> int:
        return len(self.accepted_per_round)

    def record_round(self, num_accepted: int, num_proposed: int, proposer: str) -> None:
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.accepted_per_round.append(num_accepted)
        self.proposed_per_round.append(num_proposed)
        self.proposers.add(proposer)

    @property
    def acceptance_rate(self) -> float | None:
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_prefix_tokens: int = 0  # served from the prefix cache at the last admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens that need KV before the request can decode: all known tokens but the last
        sampled one, which the next decode step feeds."""
        return self.num_tokens - (1 if self.output_token_ids else 0)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def output(self, text: str) -> RequestOutput:
        """What callers see of this request (its text detokenized by the engine)."""
        s = self.spec
        metrics = {}
        if self.first_token_time is not None:
            metrics["ttft_s"] = self.first_token_time - self.arrival_time
        if self.finish_time is not None:
            metrics["e2e_s"] = self.finish_time - self.arrival_time
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, token_ids=list(self.output_token_ids),
            text=text, finished=self.is_finished, finish_reason=self.finish_reason, error=self.error,
            num_cached_prompt_tokens=self.num_cached_prefix_tokens, acceptance_rate=s.acceptance_rate,
            num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens, num_spec_rounds=s.rounds,
            accepted_per_round=list(s.accepted_per_round), proposed_per_round=list(s.proposed_per_round),
            proposers=sorted(s.proposers), metrics=metrics)


@dataclass(frozen=True)
class StepOutput:
    """One newly generated token of one request.

    Speculative decoding may produce several StepOutputs for the same request in one engine
    step; they are always delivered in generation order. `text` is the detokenized text this
    token completes (may be "" while a multi-byte character is incomplete). `finished` is set
    on the request's last output.
    """

    request_id: str
    token_id: int
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None


@dataclass
class RequestOutput:
    """The result of one request (final, or a streaming snapshot)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    error: str | None = None
    num_cached_prompt_tokens: int = 0
    acceptance_rate: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_rounds: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    proposed_per_round: list[int] = field(default_factory=list)
    proposers: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
