"""Exports the engine's metrics (engine.metrics.METRICS) through Ray Serve's metrics API.

Why Ray's metrics: every replica's metrics go through the Ray node's metrics agent, so one
Prometheus scrape per node sees all replicas, each labelled with Serve's `replica`,
`deployment` and `application` tags, and Ray adds the `ray_` prefix to every name. The
engine thread only appends to a buffer; a flusher thread forwards it to Ray every second,
keeping metrics-library calls off the decode loop.

Scrape port: Ray serves the node's metrics on its `metrics_export_port`. `make serve` pins
it (`ray start --head --metrics-export-port 8080`, then `serve run`); with a plain
`serve run` the port is chosen at start-up and Prometheus finds it through the service
discovery file Ray writes (/tmp/ray/prom_metrics_service_discovery.json; see
dashboards/prometheus.yml).
"""

from __future__ import annotations

import logging
import threading

from engine.metrics import METRICS

log = logging.getLogger("ray.serve")  # configured by Serve in replicas


class BufferedRecorder:
    """Thread-safe Recorder that accumulates updates until `drain()`.

    The engine thread records into plain dicts (cheap: no metrics library on the decode
    path); an exporter drains them periodically and forwards them elsewhere.
    """

    def __init__(self):
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


class RayMetricsExporter:
    def __init__(self, buffer: BufferedRecorder, interval_s: float = 1.0):
        from ray.serve import metrics as serve_metrics

        self.buffer = buffer
        self.interval_s = interval_s
        self._metrics = {}
        for spec in METRICS:
            desc = spec.help + (f" [{spec.unit}]" if spec.unit else "")
            if spec.kind == "counter":
                m = serve_metrics.Counter(spec.name, description=desc, tag_keys=spec.labels)
            elif spec.kind == "gauge":
                m = serve_metrics.Gauge(spec.name, description=desc, tag_keys=spec.labels)
            else:
                m = serve_metrics.Histogram(spec.name, description=desc, boundaries=list(spec.buckets),
                                            tag_keys=spec.labels)
            self._metrics[spec.name] = m
        self.totals: dict[str, float] = {}  # every counter as exported so far, summed over labels
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-flush", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        counters, gauges, observations = self.buffer.drain()
        for (name, labels), value in counters.items():
            if value > 0:  # Ray counters reject zero increments
                self._metrics[name].inc(value, tags=dict(labels))
                self.totals[name] = self.totals.get(name, 0.0) + value
        for (name, labels), value in gauges.items():
            self._metrics[name].set(value, tags=dict(labels))
        for name, value, labels in observations:
            self._metrics[name].observe(value, tags=dict(labels))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception:  # metrics must never take the replica down
                log.exception("metrics flush failed")

    def stop(self) -> None:
        self._stop.set()
