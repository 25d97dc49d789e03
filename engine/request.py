"""A request's life in the engine, and what the engine reports about it and about each step.

`Request` is the engine's mutable record of one generation; `StepOutput` is one new token (a
speculative step may emit several per request, in order); `RequestOutput` is what callers see;
`StepResult` is what one engine step did (metrics and benchmarks read it).
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, get_args

from engine.grammar import GrammarMatcher
from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalText
from engine.uniforms import RandomStream

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV
    RUNNING = "running"  # holds KV; prefilling (chunk by chunk) or decoding
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Per-request speculation record: proposed and accepted tokens of each round."""

    accepted_per_round: list[int] = field(default_factory=list)
    proposed_per_round: list[int] = field(default_factory=list)
    proposers: set[str] = field(default_factory=set)
    k_chosen: Counter[int] = field(default_factory=Counter)  # decode steps by the K chosen for it (speculation on)
    last_proposer: str | None = None  # who proposed its last round

    def record_k(self, k: int) -> None:
        self.k_chosen[k] += 1

    def record_round(self, num_accepted: int, num_proposed: int, proposer: str) -> None:
        self.accepted_per_round.append(num_accepted)
        self.proposed_per_round.append(num_proposed)
        self.proposers.add(proposer)
        self.last_proposer = proposer

    @property
    def acceptance_rate(self) -> float | None:
        proposed = sum(self.proposed_per_round)
        return sum(self.accepted_per_round) / proposed if proposed else None


@dataclass(eq=False)  # a request is itself: identity, not field-by-field equality (the scheduler's lists)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    random_stream: RandomStream  # the uniforms its sampling and acceptance draw, from its seed
    text: IncrementalText  # the output detokenized as it arrives
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
    grammar: GrammarMatcher | None = None  # with params.structured_output: its state after the output so far
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs: one per output token
    pending_logprobs: list[TokenLogprob] | None = None  # this step's, for the tokens it emits (in order)
    prompt_logprobs: dict[int, TokenLogprob] | None = None  # with params.prompt_logprobs: by prompt position >= 1
    shares_prompt_of: Request | None = None  # admitted once that one's prompt is in KV (read from the prefix cache)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = {}

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

    def output(self) -> RequestOutput:
        """What callers see of this request."""
        s, t0 = self.spec, self.arrival_time
        metrics = {name: t - t0 for name, t in (("ttft_s", self.first_token_time), ("e2e_s", self.finish_time))
                   if t is not None}
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, token_ids=list(self.output_token_ids),
            text=self.text.text, finished=self.is_finished, finish_reason=self.finish_reason, error=self.error,
            num_cached_prompt_tokens=self.num_cached_prefix_tokens, acceptance_rate=s.acceptance_rate,
            num_draft_tokens=sum(s.proposed_per_round), num_accepted_tokens=sum(s.accepted_per_round),
            num_spec_rounds=len(s.accepted_per_round), accepted_per_round=list(s.accepted_per_round),
            proposed_per_round=list(s.proposed_per_round), proposers=sorted(s.proposers), metrics=metrics,
            k_chosen=dict(sorted(s.k_chosen.items())),
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else
            [None] + [self.prompt_logprobs.get(i) for i in range(1, len(self.prompt_token_ids))])


@dataclass(frozen=True)
class StepOutput:
    """One new token of one request (a step may give a request several, in order). `text` is what
    it completes ("" while a multi-byte character is incomplete); `finished` marks the last."""

    request_id: str
    token_id: int
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprob: TokenLogprob | None = None  # with params.logprobs


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
    k_chosen: dict[int, int] = field(default_factory=dict)  # decode steps by the K chosen for this request
    metrics: dict[str, float] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per output token (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, the first None


Phase = Literal["prefill", "draft", "target", "other"]
PHASES: tuple[Phase, ...] = get_args(Phase)

# why a decode step ran without speculation
PlainReason = Literal["disabled", "policy", "plain_probe", "disabled_batch_size", "length_guard", "request_opt_out",
                      "no_proposal", "unmeasured"]


@dataclass
class PhaseSeconds:
    """Where one step's wall time went."""

    prefill: float = 0.0  # target prompt passes and their first-token sampling
    draft: float = 0.0  # proposing: draft passes (catch-up included), n-gram lookups
    target: float = 0.0  # the target's decode or verify pass, sampling and acceptance
    other: float = 0.0  # the rest: scheduling, KV bookkeeping, detokenizing, stop checks

    def items(self) -> list[tuple[Phase, float]]:
        return [(phase, getattr(self, phase)) for phase in PHASES]


@dataclass
class DecodeStats:
    """What one decode step did. k = 0: plain decoding, for `reason`."""

    batch_size: int
    k: int = 0
    reason: str = "disabled"  # a PlainReason when k = 0; "policy", "probe", "k_probe" or "fixed" otherwise
    num_proposed: int = 0
    num_accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [k]
    proposed_by_position: list[int] = field(default_factory=list)  # [k]
    accepted_per_round: list[int] = field(default_factory=list)  # one entry per speculating request
    rows_without_proposal: int = 0
    num_tokens: int = 0
    verified_per_round: list[int] = field(default_factory=list)  # proposed tokens verified per round: a chain's K, a tree's nodes
    row_ks: list[int] = field(default_factory=list)  # [batch] the K chosen for each row (empty: speculation off)


@dataclass
class DecodeResult:
    """A decode step's new tokens per request (in order) and what it did."""

    tokens: list[tuple[Request, list[int]]]
    stats: DecodeStats
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    proposer_overhead: float = 0.0  # of draft_seconds, what proposing took outside the draft passes it timed


@dataclass
class StepResult:
    """One engine step: its outputs, its decode (None if it only prefilled), its time."""

    outputs: list[StepOutput] = field(default_factory=list)
    decode: DecodeStats | None = None
    phases: PhaseSeconds = field(default_factory=PhaseSeconds)
    num_preempted: int = 0
