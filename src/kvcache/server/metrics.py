"""The server's Prometheus metrics through ``prometheus_client``, in a registry of the app's own (two
apps in one process never share or clash).

Counters and latency histograms are recorded as requests finish (request handlers on the event
loop, the engine thread: the client's metrics are thread-safe). The engine's gauges (scheduler
queues, KV pages, prefix hit rate) are read by the caller between engine steps and handed to
``render``, which exposes exactly what was handed: a figure the engine does not have (no KV cache,
no prefix cache) is absent rather than zero.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "kvcache_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
COUNTERS = {
    "requests_total": "requests finished",
    "requests_failed_total": "requests that ended in an error",
    "requests_aborted_total": "requests whose client left before the end",
    "prompt_tokens_total": "prompt tokens of finished requests",
    "generation_tokens_total": "tokens generated for finished requests",
    "prefix_cached_tokens_total": "prompt tokens served from the prefix cache",
}


class _EngineGauges(Collector):
    """The figures handed to ``Metrics.render``: a name ending in ``_total`` is a counter, any
    other a gauge."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        for name, value in self.values.items():
            kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
            yield kind(PREFIX + name, f"engine figure {name}", value=value)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._counters = {name: Counter(PREFIX + name, doc, registry=self.registry) for name, doc in COUNTERS.items()}
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", "arrival to first token",
                               buckets=TTFT_BUCKETS, registry=self.registry)
        self._tpot = Histogram(PREFIX + "time_per_output_token_seconds", "after the first token",
                               buckets=TPOT_BUCKETS, registry=self.registry)
        self._engine = _EngineGauges()
        self.registry.register(self._engine)
        self._render_lock = threading.Lock()  # one scrape at a time owns the engine figures

    def add(self, name: str, value: float = 1) -> None:
        """Add to one of the COUNTERS."""
        self._counters[name].inc(value)

    def finished(self, prompt_tokens: int, generated: int, cached: int, ttft: float | None,
                 tpot: float | None) -> None:
        self._counters["requests_total"].inc()
        self._counters["prompt_tokens_total"].inc(prompt_tokens)
        self._counters["generation_tokens_total"].inc(generated)
        self._counters["prefix_cached_tokens_total"].inc(cached)
        if ttft is not None:
            self._ttft.observe(ttft)
        if tpot is not None:
            self._tpot.observe(tpot)

    def render(self, gauges: dict[str, float]) -> str:
        """The text exposition (format 0.0.4) of every metric; ``gauges`` are read by the caller
        from the engine."""
        with self._render_lock:
            self._engine.values = dict(gauges)
            return generate_latest(self.registry).decode()
