"""Every exported metric as data (`METRICS`: name, type, labels, unit, help), and `StepMetrics`,
which turns a step's StepResult into updates of any `Recorder`. The exporter (serve_app), the
documentation's metrics table (generated), the dashboard and the tests are all checked against `METRICS`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from engine.request import DecodeStats, PlainReason

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
               "Decode steps run without speculation, by reason (" + ", ".join(get_args(PlainReason)) + ").",
               ("model", "reason"), "steps"),
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
    MetricSpec("specserve_prefix_cache_hit_tokens_total", "counter",
               "Prompt tokens of finished requests read from the prefix cache at admission (their K/V not "
               "recomputed); divided by specserve_prompt_tokens_total is the prefix cache's hit rate.", unit="tokens"),
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
    MetricSpec("specserve_verified_tokens_per_round", "histogram",
               "Proposed tokens one speculation round verified: a chain's K, a token tree's nodes.", unit="tokens",
               buckets=LENGTH_BUCKETS),
    MetricSpec("specserve_request_acceptance_rate", "histogram",
               "Per finished request: accepted / proposed tokens (requests that speculated).", buckets=RATE_BUCKETS),
    MetricSpec("specserve_running_requests", "gauge", "Requests holding KV (prefilling or decoding).",
               unit="requests"),
    MetricSpec("specserve_waiting_requests", "gauge", "Requests queued for admission.", unit="requests"),
    MetricSpec("specserve_kv_usage_fraction", "gauge", "Fraction of the KV pool's blocks in use.",
               ("model", "pool")),
    MetricSpec("specserve_spec_k_per_request", "histogram",
               "Tokens proposed per round chosen for each request of each decode step while speculation is on "
               "(0 = the request decoded one token; one K a step, or each its own with k_per_request).",
               unit="tokens", buckets=LENGTH_BUCKETS),
    MetricSpec("specserve_spec_k", "gauge", "Tokens proposed per round chosen for the last decode step (0 = plain).",
               unit="tokens"),
    MetricSpec("specserve_spec_steps_total", "counter",
               "Decode steps while speculation is on, by the K the step ran (0 = plain) and why: policy, fixed, "
               "probe, k_probe, plain_probe, or a reason for plain decoding.", ("model", "k", "reason"), "steps"),
    MetricSpec("specserve_spec_predicted_seconds_total", "counter",
               "Self-check: decode step seconds the measured costs predicted for the plan each step ran, by batch "
               "(the decode batch size rounded up to a power of two), k (the K chosen, 0 = plain) and phase (draft, "
               "verify, other). Steps that also prefill or finish a request are left out.",
               ("model", "batch", "k", "phase"), "seconds"),
    MetricSpec("specserve_spec_realized_seconds_total", "counter",
               "Self-check: the seconds those steps took, by batch, k and phase; predicted / realized near 1 says "
               "the prices the adaptive policy chooses by are right there.", ("model", "batch", "k", "phase"),
               "seconds"),
    MetricSpec("specserve_spec_predicted_tokens_total", "counter",
               "Self-check: tokens the acceptance estimates predicted those steps would produce, by batch and k.",
               ("model", "batch", "k"), "tokens"),
    MetricSpec("specserve_spec_realized_tokens_total", "counter",
               "Self-check: tokens those steps produced, by batch and k.", ("model", "batch", "k"), "tokens"),
    MetricSpec("specserve_spec_prediction_ratio", "gauge",
               "Self-check: sum predicted / sum realized since start-up, by batch, k and quantity (seconds: a "
               "whole step's; tokens).", ("model", "batch", "k", "quantity")),
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


class StepMetrics:
    """Feeds a Recorder from the engine after each step (call `on_step` on the engine thread)."""

    def __init__(self, recorder: Recorder, model: str):
        self.recorder = recorder
        self.model = model
        self._last_output_time: dict[str, float] = {}
        self._self_check: dict[tuple[str, str], list[float]] = {}  # (batch, k) -> predicted/realized tokens, seconds

    def _labels(self, **extra) -> dict[str, str]:
        return {"model": self.model, **extra}

    def on_step(self, engine, outputs: list) -> None:
        """Records the engine's last step (`engine.last_step`) and its outputs."""
        rec, now, base = self.recorder, time.monotonic(), self._labels()
        per_request = Counter(o.request_id for o in outputs if o.token_id >= 0)
        if per_request:
            rec.inc("specserve_generation_tokens_total", per_request.total(), base)
        for rid, n in per_request.items():
            if (req := engine.request(rid)) is None:
                continue
            last = self._last_output_time.get(rid)
            if last is not None:
                rec.observe("specserve_inter_token_latency_seconds", (now - last) / n, base)
            elif req.first_token_time is not None:
                rec.observe("specserve_time_to_first_token_seconds", req.first_token_time - req.arrival_time, base)
            self._last_output_time[rid] = now
        for o in outputs:
            if o.finished:
                self._on_finish(engine, o.request_id, o.finish_reason, now)
        step = engine.last_step
        if step.decode is not None:
            self._on_decode(step.decode)
            speculation = getattr(engine, "speculation", None)
            self._on_self_check(speculation.planner.self_check if speculation is not None else None, step.decode)
        for phase, seconds in step.phases.items():
            if seconds > 0:
                rec.inc("specserve_engine_seconds_total", seconds, self._labels(phase=phase))
        if step.num_preempted:
            rec.inc("specserve_preemptions_total", step.num_preempted, base)
        rec.set("specserve_running_requests", engine.num_running(), base)
        rec.set("specserve_waiting_requests", engine.num_waiting(), base)
        for pool, fraction in engine.kv.usage().items():
            rec.set("specserve_kv_usage_fraction", fraction, self._labels(pool=pool))

    def _on_decode(self, s: DecodeStats) -> None:
        rec, base = self.recorder, self._labels()
        rec.inc("specserve_decode_steps_total", 1, base)
        rec.inc("specserve_decode_sequence_steps_total", s.batch_size, base)
        rec.inc("specserve_decode_tokens_total", s.num_tokens, base)
        rec.set("specserve_spec_k", s.k, base)
        for k in s.row_ks:
            rec.observe("specserve_spec_k_per_request", k, base)
        if s.row_ks:  # speculation on
            rec.inc("specserve_spec_steps_total", 1, self._labels(k=str(s.k), reason=s.reason))
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
        for n in s.verified_per_round:
            rec.observe("specserve_verified_tokens_per_round", n, base)

    def _on_self_check(self, check, stats: DecodeStats) -> None:
        """The step's prediction against what it realized (speculative/self_check.py), if it kept one."""
        record = getattr(check, "last", None)
        if record is None or record.stats is not stats:
            return
        rec, p = self.recorder, record.predicted
        labels = {"batch": str(1 << max(0, p.batch - 1).bit_length()), "k": str(p.k)}
        for phase, seconds in p.seconds.items():
            rec.inc("specserve_spec_predicted_seconds_total", seconds, self._labels(phase=phase, **labels))
            rec.inc("specserve_spec_realized_seconds_total", record.seconds[phase], self._labels(phase=phase, **labels))
        rec.inc("specserve_spec_predicted_tokens_total", p.tokens, self._labels(**labels))
        rec.inc("specserve_spec_realized_tokens_total", record.tokens, self._labels(**labels))
        sums = self._self_check.setdefault((labels["batch"], labels["k"]), [0.0] * 4)
        for i, v in enumerate((p.tokens, record.tokens, sum(p.seconds.values()), sum(record.seconds.values()))):
            sums[i] += v
        for quantity, (predicted, realized) in (("tokens", sums[:2]), ("seconds", sums[2:])):
            if realized > 0:
                rec.set("specserve_spec_prediction_ratio", predicted / realized, self._labels(quantity=quantity, **labels))

    def _on_finish(self, engine, rid: str, reason: str | None, now: float) -> None:
        rec, base = self.recorder, self._labels()
        self._last_output_time.pop(rid, None)
        req = engine.request(rid)
        if req is None:
            return
        proposer = "+".join(sorted(req.spec.proposers)) or "none"
        rec.inc("specserve_requests_total", 1, self._labels(finish_reason=reason or "unknown", proposer=proposer))
        rec.inc("specserve_prompt_tokens_total", len(req.prompt_token_ids), base)
        rec.inc("specserve_prefix_cache_hit_tokens_total", min(req.num_cached_prefix_tokens, len(req.prompt_token_ids)),
                base)
        rec.observe("specserve_e2e_request_latency_seconds", now - req.arrival_time, base)
        if req.spec.acceptance_rate is not None:
            rec.observe("specserve_request_acceptance_rate", req.spec.acceptance_rate, base)
