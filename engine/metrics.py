"""Engine metrics as data: the one list of every exported metric, and the step recorder.

`METRICS` defines each metric's name, type, labels, unit and help; the exporter (Ray Serve
metrics in serve_app/metrics.py), the README table, the Grafana dashboard and the tests are
all checked against it. `StepMetrics` turns what an engine step did into metric updates for
any `Recorder`, so the engine itself stays free of any metrics library.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

Kind = Literal["counter", "gauge", "histogram"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 60.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 300.0, 600.0)
LENGTH_BUCKETS = (0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 12.5, 16.5, 32.5, 64.5)
RATE_BUCKETS = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95, 1.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ("model",)
    unit: str = ""
    buckets: tuple[float, ...] = ()


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("specserve_draft_tokens_total", "counter", "Tokens proposed by the speculative proposer(s).", unit="tokens"),
    MetricSpec("specserve_draft_accepted_tokens_total", "counter", "Proposed tokens the target accepted.", unit="tokens"),
    MetricSpec("specserve_accepted_tokens_by_position_total", "counter",
               "Accepted proposed tokens by draft position (1 = first proposed token).", ("model", "position"), "tokens"),
    MetricSpec("specserve_proposed_tokens_by_position_total", "counter",
               "Proposed tokens by draft position (1 = first proposed token).", ("model", "position"), "tokens"),
    MetricSpec("specserve_spec_rounds_total", "counter", "Speculation rounds (one per request per speculative step).",
               unit="rounds"),
    MetricSpec("specserve_non_spec_decode_steps_total", "counter",
               "Decode steps run without speculation, by reason (policy, no_proposal, length_guard, "
               "disabled, disabled_batch_size).", ("model", "reason"), "steps"),
    MetricSpec("specserve_decode_steps_total", "counter", "Engine decode steps (one batched target forward each).",
               unit="steps"),
    MetricSpec("specserve_decode_sequence_steps_total", "counter",
               "Sequences processed by decode steps (sum of decode batch sizes).", unit="sequences"),
    MetricSpec("specserve_decode_tokens_total", "counter", "Tokens produced by decode steps.", unit="tokens"),
    MetricSpec("specserve_generation_tokens_total", "counter", "Generated tokens (all, incl. first tokens).",
               unit="tokens"),
    MetricSpec("specserve_preemptions_total", "counter",
               "Requests preempted because the KV pool was full (their KV is freed and recomputed later).",
               unit="requests"),
    MetricSpec("specserve_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", unit="tokens"),
    MetricSpec("specserve_requests_total", "counter", "Finished requests by finish reason and proposer.",
               ("model", "finish_reason", "proposer"), "requests"),
    MetricSpec("specserve_time_to_first_token_seconds", "histogram", "Arrival to first token.", unit="seconds",
               buckets=LATENCY_BUCKETS),
    MetricSpec("specserve_inter_token_latency_seconds", "histogram",
               "Gap between a request's consecutive outputs divided by the tokens they carried.", unit="seconds",
               buckets=LATENCY_BUCKETS),
    MetricSpec("specserve_e2e_request_latency_seconds", "histogram", "Arrival to finish.", unit="seconds",
               buckets=E2E_BUCKETS),
    MetricSpec("specserve_accepted_length_per_round", "histogram", "Accepted proposed tokens per speculation round.",
               unit="tokens", buckets=LENGTH_BUCKETS),
    MetricSpec("specserve_request_acceptance_rate", "histogram",
               "Per finished request: accepted / proposed tokens (requests that speculated).", buckets=RATE_BUCKETS),
    MetricSpec("specserve_running_requests", "gauge", "Requests holding KV (prefilling or decoding).",
               unit="requests"),
    MetricSpec("specserve_waiting_requests", "gauge", "Requests queued for admission.", unit="requests"),
    MetricSpec("specserve_kv_usage_fraction", "gauge", "Fraction of the KV pool in use (blocks, or slots).",
               ("model", "pool")),
    MetricSpec("specserve_spec_k", "gauge", "Tokens proposed per round chosen for the last decode step (0 = plain).",
               unit="tokens"),
    MetricSpec("specserve_engine_seconds_total", "counter",
               "Engine step wall time by phase: prefill (prompt passes), draft (proposing, the draft's catch-up "
               "included), target (decode or verify pass with sampling and acceptance), other (scheduling, KV "
               "bookkeeping, detokenizing, stop checks).", ("model", "phase"), "seconds"),
)
METRIC_BY_NAME = {m.name: m for m in METRICS}


class Recorder(Protocol):
    def inc(self, name: str, value: float, labels: dict[str, str]) -> None: ...
    def set(self, name: str, value: float, labels: dict[str, str]) -> None: ...
    def observe(self, name: str, value: float, labels: dict[str, str]) -> None: ...


@dataclass
class DecodeStepStats:
    """What one decode step did (filled by the runner; plain decode leaves k = 0)."""

    batch_size: int = 0
    k: int = 0
    reason: str = "disabled"
    num_proposed: int = 0
    num_accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [k]
    proposed_by_position: list[int] = field(default_factory=list)  # [k]
    accepted_per_round: list[int] = field(default_factory=list)  # one entry per speculating request
    rows_without_proposal: int = 0
    num_tokens: int = 0


Phase = Literal["prefill", "draft", "target", "other"]
PHASES: tuple[Phase, ...] = get_args(Phase)


@dataclass
class PhaseSeconds:
    """Where one engine step's wall time went (filled by the runner; `other` is what the engine
    adds: the step's wall time minus the phases the runner timed)."""

    prefill: float = 0.0  # target prompt passes and their first-token sampling
    draft: float = 0.0  # proposing: draft passes (catch-up and lazy prefill included), n-gram lookups
    target: float = 0.0  # the target's decode or verify pass, sampling and acceptance
    other: float = 0.0

    def items(self) -> list[tuple[Phase, float]]:
        return [(phase, getattr(self, phase)) for phase in PHASES]


class InMemoryRecorder:
    """A Recorder that keeps values in dicts (tests, the stats endpoint)."""

    def __init__(self):
        self.counters: dict[tuple, float] = {}
        self.gauges: dict[tuple, float] = {}
        self.observations: dict[tuple, list[float]] = {}

    @staticmethod
    def _key(name: str, labels: dict[str, str]) -> tuple:
        return (name, *sorted(labels.items()))

    def inc(self, name, value, labels):
        key = self._key(name, labels)
        self.counters[key] = self.counters.get(key, 0.0) + value

    def set(self, name, value, labels):
        self.gauges[self._key(name, labels)] = value

    def observe(self, name, value, labels):
        self.observations.setdefault(self._key(name, labels), []).append(value)

    def total(self, name: str, **labels) -> float:
        return sum(v for k, v in self.counters.items() if k[0] == name and all((lk, lv) in k[1:] for lk, lv in labels.items()))


class StepMetrics:
    """Feeds a Recorder from the engine after each step (call `on_step` on the engine thread)."""

    def __init__(self, recorder: Recorder, model: str):
        self.recorder = recorder
        self.model = model
        self._last_output_time: dict[str, float] = {}

    def _labels(self, **extra) -> dict[str, str]:
        return {"model": self.model, **extra}

    def on_step(self, engine, outputs: list) -> None:
        rec, now = self.recorder, time.monotonic()
        base = self._labels()
        per_request: dict[str, int] = {}
        for o in outputs:
            if o.token_id >= 0:
                per_request[o.request_id] = per_request.get(o.request_id, 0) + 1
        generated = sum(per_request.values())
        if generated:
            rec.inc("specserve_generation_tokens_total", generated, base)
        for rid, n in per_request.items():
            req = engine._requests.get(rid)
            if req is None:
                continue
            last = self._last_output_time.get(rid)
            if last is None:
                if req.first_token_time is not None:
                    rec.observe("specserve_time_to_first_token_seconds", req.first_token_time - req.arrival_time, base)
            else:
                rec.observe("specserve_inter_token_latency_seconds", (now - last) / n, base)
            self._last_output_time[rid] = now
        for o in outputs:
            if o.finished:
                self._on_finish(engine, o.request_id, o.finish_reason, now)
        stats: DecodeStepStats | None = getattr(engine.runner, "last_decode", None)
        if stats is not None and stats.batch_size:
            self._on_decode(stats)
        for phase, seconds in engine.last_step_phases.items():
            if seconds > 0:
                rec.inc("specserve_engine_seconds_total", seconds, self._labels(phase=phase))
        if engine.last_step_preemptions:
            rec.inc("specserve_preemptions_total", engine.last_step_preemptions, base)
        rec.set("specserve_running_requests", engine.num_running(), base)
        rec.set("specserve_waiting_requests", engine.num_waiting(), base)
        for pool, fraction in engine.kv_usage_fractions().items():
            rec.set("specserve_kv_usage_fraction", fraction, self._labels(pool=pool))

    def _on_decode(self, s: DecodeStepStats) -> None:
        rec, base = self.recorder, self._labels()
        rec.inc("specserve_decode_steps_total", 1, base)
        rec.inc("specserve_decode_sequence_steps_total", s.batch_size, base)
        rec.inc("specserve_decode_tokens_total", s.num_tokens, base)
        rec.set("specserve_spec_k", s.k, base)
        if s.k == 0:
            rec.inc("specserve_non_spec_decode_steps_total", 1, self._labels(reason=s.reason))
            return
        rec.inc("specserve_draft_tokens_total", s.num_proposed, base)
        rec.inc("specserve_draft_accepted_tokens_total", s.num_accepted, base)
        rec.inc("specserve_spec_rounds_total", len(s.accepted_per_round), base)
        for i, (acc, prop) in enumerate(zip(s.accepted_by_position, s.proposed_by_position), start=1):
            if prop:
                rec.inc("specserve_proposed_tokens_by_position_total", prop, self._labels(position=str(i)))
                rec.inc("specserve_accepted_tokens_by_position_total", acc, self._labels(position=str(i)))
        for a in s.accepted_per_round:
            rec.observe("specserve_accepted_length_per_round", a, base)

    def _on_finish(self, engine, rid: str, reason: str | None, now: float) -> None:
        rec, base = self.recorder, self._labels()
        self._last_output_time.pop(rid, None)
        req = engine._requests.get(rid)
        if req is None:
            return
        proposer = "+".join(sorted(req.spec.proposers)) or "none"
        rec.inc("specserve_requests_total", 1, self._labels(finish_reason=reason or "unknown", proposer=proposer))
        rec.inc("specserve_prompt_tokens_total", len(req.prompt_token_ids), base)
        rec.observe("specserve_e2e_request_latency_seconds", now - req.arrival_time, base)
        if req.spec.acceptance_rate is not None:
            rec.observe("specserve_request_acceptance_rate", req.spec.acceptance_rate, base)


class BufferedRecorder:
    """Thread-safe Recorder that accumulates updates until `drain()`.

    The engine thread records into plain dicts (cheap: no metrics library on the decode
    path); an exporter drains them periodically and forwards them elsewhere.
    """

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._counters: dict[tuple, float] = {}
        self._gauges: dict[tuple, float] = {}
        self._observations: list[tuple[str, float, tuple]] = []

    def inc(self, name, value, labels):
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + value

    def set(self, name, value, labels):
        with self._lock:
            self._gauges[(name, tuple(sorted(labels.items())))] = value

    def observe(self, name, value, labels):
        with self._lock:
            self._observations.append((name, value, tuple(sorted(labels.items()))))

    def drain(self) -> tuple[dict, dict, list]:
        """Returns and clears (counter increments, latest gauge values, observations)."""
        with self._lock:
            out = (self._counters, self._gauges, self._observations)
            self._counters, self._gauges, self._observations = {}, {}, []
        return out
