"""What one engine step did, as typed records: the engine, metrics and benchmarks read these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from engine.request import Request, StepOutput

Phase = Literal["prefill", "draft", "target", "other"]
PHASES: tuple[Phase, ...] = get_args(Phase)

# why a decode step ran without speculation
PlainReason = Literal["disabled", "policy", "disabled_batch_size", "length_guard", "request_opt_out", "no_proposal"]


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
    reason: str = "disabled"  # a PlainReason when k = 0; "policy", "probe" or "fixed" otherwise
    num_proposed: int = 0
    num_accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [k]
    proposed_by_position: list[int] = field(default_factory=list)  # [k]
    accepted_per_round: list[int] = field(default_factory=list)  # one entry per speculating request
    rows_without_proposal: int = 0
    num_tokens: int = 0


@dataclass
class DecodeResult:
    """A decode step's new tokens per request (in order) and what it did."""

    tokens: list[tuple[Request, list[int]]]
    stats: DecodeStats
    draft_seconds: float = 0.0
    target_seconds: float = 0.0


@dataclass
class StepResult:
    """One engine step: its outputs, its decode (None if it only prefilled), its time."""

    outputs: list[StepOutput] = field(default_factory=list)
    decode: DecodeStats | None = None
    phases: PhaseSeconds = field(default_factory=PhaseSeconds)
    num_preempted: int = 0
