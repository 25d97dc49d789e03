"""Builds dashboards/specserve-grafana.json (run after editing the panels below).

    python dashboards/build.py

Every expression names metrics from engine.metrics.METRICS (Ray adds the `ray_` prefix) or
Ray Serve's own metrics; tests/e2e/test_metrics_prometheus.py evaluates each one against a
real Prometheus scraping the running app.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "specserve-grafana.json"
SEL = '{model=~"$model", replica=~"$replica"}'
RI = "$__rate_interval"


def rate(metric: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping}(rate(ray_{metric}{SEL}[{RI}]))"


def quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le)(rate(ray_{metric}_bucket{SEL}[{RI}])))"


# (title, unit, [(expr, legend)], description)
PANELS = [
    ("Acceptance rate", "percentunit",
     [(f"{rate('specserve_draft_accepted_tokens_total')} / {rate('specserve_draft_tokens_total')}", "acceptance")],
     "Accepted ÷ proposed draft tokens across all requests."),
    ("Mean accepted length per round", "short",
     [(f"{rate('specserve_draft_accepted_tokens_total')} / {rate('specserve_spec_rounds_total')}", "accepted / round")],
     "Proposed tokens accepted per speculation round (each round also emits one target token)."),
    ("Verified and accepted tokens per round", "short",
     [(f"{rate('specserve_verified_tokens_per_round_sum')} / {rate('specserve_verified_tokens_per_round_count')}",
       "verified / round"),
      (f"{rate('specserve_accepted_length_per_round_sum')} / {rate('specserve_accepted_length_per_round_count')}",
       "accepted / round")],
     "Proposed tokens each speculation round verified (a chain's K; a token tree's nodes, with tree_width > 1) "
     "and how many of them it accepted (a tree: its accepted path's length)."),
    ("Acceptance by draft position", "percentunit",
     [(f"{rate('specserve_accepted_tokens_by_position_total', 'position')} / "
       f"{rate('specserve_proposed_tokens_by_position_total', 'position')}", "position {{position}}")],
     "Probability that the i-th proposed token is accepted given it was proposed; falls with position."),
    ("Proposed / accepted / rejected tokens per second", "short",
     [(rate("specserve_draft_tokens_total"), "proposed"),
      (rate("specserve_draft_accepted_tokens_total"), "accepted"),
      (f"{rate('specserve_draft_tokens_total')} - {rate('specserve_draft_accepted_tokens_total')}", "rejected")],
     "Proposer traffic: rejected tokens are the speculation's wasted work."),
    ("Tokens per target forward pass (effective speedup)", "short",
     [(f"{rate('specserve_decode_tokens_total')} / {rate('specserve_decode_sequence_steps_total')}", "tokens / pass")],
     "Tokens each sequence gains per target decode forward; 1.0 = plain decode."),
    ("Fallback to plain decode by reason", "percentunit",
     [(f"{rate('specserve_non_spec_decode_steps_total', 'reason')} / scalar({rate('specserve_decode_steps_total')})",
       "{{reason}}")],
     "Share of decode steps run without speculation: policy (adaptive K chose 0), plain_probe (the adaptive "
     "policy re-measuring plain decoding while it speculates), no_proposal, length_guard, request_opt_out (every request in the step sent spec_length 0), unmeasured (a cold start, before the largest batch is calibrated), disabled, disabled_batch_size."),
    ("Current K", "short",
     [(f"max by (replica)(ray_specserve_spec_k{SEL})", "{{replica}}")],
     "Proposed tokens per round chosen by the policy for the last decode step (0 = plain decode)."),
    ("K chosen per request", "short",
     [(f"{rate('specserve_spec_k_per_request_sum')} / {rate('specserve_spec_k_per_request_count')}", "mean K a request"),
      (f"sum(rate(ray_specserve_spec_k_per_request_bucket{{le=\"0.5\", model=~\"$model\", replica=~\"$replica\"}}[{RI}])) / "
       f"{rate('specserve_spec_k_per_request_count')}", "share of requests at K = 0")],
     "The K chosen for each request of each decode step while speculation is on: its mean, and the share of "
     "requests that decoded one token (K = 0). With k_per_request, requests that accept little sit at 0 while "
     "the others keep speculating; with one K a step, the share is all or nothing."),
    ("K chosen and why", "percentunit",
     [(f"{rate('specserve_spec_steps_total', 'k, reason')} / scalar({rate('specserve_spec_steps_total')})",
       "K = {{k}} ({{reason}})")],
     "Share of decode steps (speculation on) by the K they ran and why: policy (the adaptive verdict), fixed, "
     "probe / k_probe / plain_probe (exploration, at most 2% of adaptive steps), or a reason for plain decoding. "
     "Read the self-check panels beside it at the same K."),
    ("Self-check: predicted ÷ realized step seconds", "short",
     [(f"{rate('specserve_spec_predicted_seconds_total', 'batch, k')} / "
       f"{rate('specserve_spec_realized_seconds_total', 'batch, k')}", "batch ≤ {{batch}}, K = {{k}}")],
     "Σ predicted ÷ Σ realized decode step seconds per (batch, K chosen) over the rate window: the measured "
     "costs' price of the plan each step ran against what it took. 1.0 = priced right; above 1 the policy "
     "thinks that K dearer than it is. Steps that also prefill or finish a request are left out."),
    ("Self-check: predicted ÷ realized tokens", "short",
     [(f"{rate('specserve_spec_predicted_tokens_total', 'batch, k')} / "
       f"{rate('specserve_spec_realized_tokens_total', 'batch, k')}", "batch ≤ {{batch}}, K = {{k}}")],
     "Σ predicted ÷ Σ realized tokens per (batch, K chosen): the acceptance estimates' expected tokens against "
     "the tokens the steps produced. Above 1 the policy expects more acceptance than it gets."),
    ("Self-check: predicted ÷ realized seconds by phase", "short",
     [(f"{rate('specserve_spec_predicted_seconds_total', 'phase')} / "
       f"{rate('specserve_spec_realized_seconds_total', 'phase')}", "{{phase}}")],
     "Σ predicted ÷ Σ realized seconds of each phase over every self-checked step: draft (the draft passes and "
     "catch-ups), verify (the target pass with sampling and acceptance), other (the rest of the step)."),
    ("Engine time by phase", "percentunit",
     [(f"{rate('specserve_engine_seconds_total', 'phase')} / scalar(count(count by (replica)"
       f"(ray_specserve_running_requests{SEL})))", "{{phase}}")],
     "Share of each replica's wall time its engine steps spent per phase (averaged over replicas): "
     "draft passes, target decode/verify passes, prefill, and the engine's own bookkeeping. Below 100% "
     "in all = idle. Where speculation's time goes: a large draft share with low acceptance says "
     "K is too high."),
    ("Time to first token", "s",
     [(quantile(q, "specserve_time_to_first_token_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.95, 0.99)],
     "Arrival to first token, quantiles over the rate window."),
    ("Inter-token latency", "s",
     [(quantile(q, "specserve_inter_token_latency_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.95, 0.99)],
     "Gap between a request's consecutive outputs ÷ tokens they carried."),
    ("Throughput", "short",
     [(rate("specserve_generation_tokens_total"), "generated tokens/s"),
      (rate("specserve_prompt_tokens_total"), "prompt tokens/s")],
     "Tokens per second across replicas."),
    ("Running and waiting requests", "short",
     [(f"sum(ray_specserve_running_requests{SEL})", "running"),
      (f"sum(ray_specserve_waiting_requests{SEL})", "waiting")],
     "Requests holding KV vs queued for admission."),
    ("KV cache usage", "percentunit",
     [(f"max by (pool)(ray_specserve_kv_usage_fraction{SEL})", "{{pool}}")],
     "Fraction of the target and draft KV pools in use (worst replica)."),
    ("Prefix cache hit rate", "percentunit",
     [(f"sum by (replica)(rate(ray_specserve_prefix_cache_hit_tokens_total{SEL}[{RI}])) / "
       f"sum by (replica)(rate(ray_specserve_prompt_tokens_total{SEL}[{RI}]))", "{{replica}}")],
     "Share of each replica's prompt tokens read from its prefix cache instead of recomputed. With several "
     "replicas, a prefix-aware router (serve_config.ingress.yaml) keeps this up as replicas are added."),
    ("Replicas", "short",
     [(f"count(count by (replica)(ray_specserve_running_requests{SEL}))", "replicas")],
     "Engine replicas reporting metrics."),
]


def build() -> dict:
    panels = []
    for i, (title, unit, targets, desc) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title, "description": desc,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(targets)],
        })
    variable = {"type": "prometheus", "uid": "${datasource}"}
    return {
        "title": "specserve — speculative decoding", "uid": "specserve-spec", "schemaVersion": 39, "version": 1,
        "editable": True, "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["specserve", "ray-serve"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "model", "type": "query", "datasource": variable, "includeAll": True, "multi": True,
             "allValue": ".*", "refresh": 2, "query": "label_values(ray_specserve_generation_tokens_total, model)"},
            {"name": "replica", "type": "query", "datasource": variable, "includeAll": True, "multi": True,
             "allValue": ".*", "refresh": 2,
             "query": 'label_values(ray_specserve_running_requests{model=~"$model"}, replica)'},
        ]},
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {OUT}")
