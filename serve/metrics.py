"""Prometheus metrics at GET /metrics, under vLLM's names with a `dsv4gen:` prefix (so existing
dashboards need only the prefix changed; research/serving.md §6).

Per-request numbers (tokens, latencies, finish reasons) are recorded on the event loop as outputs
arrive; engine state (queue depth, cache blocks, speculative counters) is read at scrape time from
the snapshot the engine thread publishes after each step, never from the live engine.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "dsv4gen:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed", labels, registry=self.registry)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens emitted (never drafted ones)", labels,
                                         registry=self.registry)
        self.request_success = Counter(P + "request_success", "Finished requests by finish reason",
                                       labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter(P + "requests_rejected", "Requests refused before generation, by HTTP status",
                                labels + ["status"], registry=self.registry)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between successive token-bearing outputs",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.batch = Histogram(P + "iteration_requests", "Requests in the running batch after each engine step",
                               labels, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self._last_token: dict[str, float] = {}
        self._engine = None

    def attach(self, async_engine) -> None:
        """Start reading engine state at scrape time."""
        self._engine = async_engine
        self.registry.register(_EngineCollector(self))

    # ---- hooks of serve.async_engine ----------------------------------------------------------
    def on_submit(self, prompt_len: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_len)

    def on_output(self, handle, out) -> None:
        now, rid = time.monotonic(), out.request_id
        if out.new_tokens:
            self.generation_tokens.labels(self.model_name).inc(len(out.new_tokens))
            last = self._last_token.get(rid)
            (self.ttft if last is None else self.itl).labels(self.model_name).observe(
                now - (handle.arrival if last is None else last))
            self._last_token[rid] = now
        if out.finished:
            self._finish(handle, out.finish_reason or "stop", now)

    def on_abort(self, handle) -> None:
        self._finish(handle, "abort", time.monotonic())

    def _finish(self, handle, reason: str, now: float) -> None:
        self._last_token.pop(handle.request_id, None)
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(now - handle.arrival)

    def on_step(self, running: int) -> None:
        self.batch.labels(self.model_name).observe(running)

    def on_rejected(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters read from the engine thread's last published snapshot."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        engine, name = self.metrics._engine, self.metrics.model_name
        snap = engine.snapshot

        def gauge(metric: str, doc: str, value: float, **labels):
            family = GaugeMetricFamily(P + metric, doc, labels=["model_name", *labels])
            family.add_metric([name, *labels.values()], value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch", snap.running)
        yield gauge("num_requests_waiting", "Requests queued for admission", snap.waiting)
        yield gauge("engine_healthy", "1 while the engine thread runs, 0 once it failed", 0 if engine.dead else 1)
        # the fullest pool is the one that refuses the next request: sequence slots or an entry group
        usage = max((u / t for _, u, t in snap.blocks if t), default=0.0)
        yield gauge("kv_cache_usage_perc", "Fraction of the fullest cache pool in use (1.0 = full)", usage)
        for metric, column, doc in (("kv_cache_blocks_used", 1, "Cache blocks (entry groups c<m>) or sequence slots in use, per pool"),
                                    ("kv_cache_blocks_total", 2, "Cache blocks (entry groups c<m>) or sequence slots, per pool")):
            family = GaugeMetricFamily(P + metric, doc, labels=["model_name", "group"])
            for row in snap.blocks:
                family.add_metric([name, row[0]], row[column])
            yield family
        yield _counter("num_preemptions", "Running requests preempted (recomputed later)", name, snap.preemptions)
        yield _counter("spec_decode_num_drafts", "Draft rounds verified", name, snap.drafted[0] if snap.drafted else 0)
        yield _counter("spec_decode_num_draft_tokens", "Draft tokens verified", name, sum(snap.drafted))
        yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", name, sum(snap.accepted))
        family = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens per position",
                                     labels=["model_name", "position"])
        for position, count in enumerate(snap.accepted):
            family.add_metric([name, str(position)], count)
        yield family


def _counter(metric: str, doc: str, name: str, value: int) -> CounterMetricFamily:
    family = CounterMetricFamily(P + metric, doc, labels=["model_name"])
    family.add_metric([name], value)
    return family
